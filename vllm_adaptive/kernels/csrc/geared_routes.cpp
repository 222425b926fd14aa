// Every gear of a geared linear without a Python frame: one op that a compiled graph calls for
// the layer, which runs the tier the step's rows all run (the layer's `uniform` flag holds its
// route code) through that tier's C++ op, or the layer's own oneDNN GEMM for the full gear.
//
// The per-tier ops (geared_fp16_linear, geared_int4_linear, geared_int8_linear) each serve one
// tier: a layer whose gears differ from step to step (GEARBX, QuickSilver) ran every other gear
// through the plugin's Python op, about 30 us a call and 121 calls a step on the default model.
// Here a layer registers each tier it can run in C++ once (the tensors the tier's op takes, held
// until the layer clears them), and the step's flag picks one; code 0, an unregistered code or
// rows of a mixed step go to the Python op as before.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "blocked_weight.h"

namespace {

// route codes (GearedLinear.ROUTE_CODES): the value of a layer's `uniform` flag
constexpr int kFp16 = 1, kInt4 = 2, kInt8 = 3, kFull = 4, kCodes = 5;

struct Route {
  bool set = false;
  std::vector<std::optional<at::Tensor>> t;  // the tier op's tensors, in its argument order
  int64_t group = 0;                         // int4pack's group length
};

struct Layer {
  Route by_code[kCodes];
};

std::mutex mu;
std::unordered_map<int64_t, Layer> layers;  // the geared linear's index -> its routes

void put(int64_t index, int code, Route r) {
  r.set = true;
  std::lock_guard<std::mutex> lock(mu);
  layers[index].by_code[code] = std::move(r);
}

std::optional<Route> get(int64_t index, int code) {
  std::lock_guard<std::mutex> lock(mu);
  const auto it = layers.find(index);
  if (it == layers.end() || !it->second.by_code[code].set) return std::nullopt;
  return it->second.by_code[code];
}

void route_fp16(int64_t index, const at::Tensor& packed, const std::optional<at::Tensor>& fbgemm,
                const at::Tensor& native_rows) {
  put(index, kFp16, Route{true, {packed, fbgemm, native_rows}, 0});
}

void route_int4(int64_t index, const at::Tensor& packed, const at::Tensor& scales,
                const at::Tensor& offsets, const std::optional<at::Tensor>& int4pack,
                const std::optional<at::Tensor>& int4pack_scale_zeros, int64_t int4pack_group,
                const at::Tensor& native_rows) {
  put(index, kInt4,
      Route{true, {packed, scales, offsets, int4pack, int4pack_scale_zeros, native_rows},
            int4pack_group});
}

void route_int8(int64_t index, const at::Tensor& packed, const at::Tensor& scales,
                const at::Tensor& native_rows) {
  put(index, kInt8, Route{true, {packed, scales, native_rows}, 0});
}

// the layer's own weight as vLLM's CPU linear runs it: its oneDNN GEMM handle (and bias)
void route_full(int64_t index, const at::Tensor& onednn_handler,
                const std::optional<at::Tensor>& bias) {
  put(index, kFull, Route{true, {onednn_handler, bias}, 0});
}

void clear_routes(int64_t index) {
  std::lock_guard<std::mutex> lock(mu);
  layers.erase(index);
}

// the tier ops' flag argument: "every row runs this op's gear"
const at::Tensor& set_flag() {
  static const at::Tensor flag = at::ones({1}, at::kByte);
  return flag;
}

at::Tensor run_full(const Route& r, const at::Tensor& x, int64_t out_features) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("_C::onednn_mm", "")
                             .typed<void(at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, const at::Tensor&)>();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  op.call(out, x, r.t[1], *r.t[0]);
  return out;
}

at::Tensor geared_linear_routed(const at::Tensor& x, const at::Tensor& uniform, int64_t index,
                                int64_t out_features) {
  const int code = uniform.data_ptr<uint8_t>()[0];
  const auto dtype = x.scalar_type();
  std::optional<Route> r;
  if (code > 0 && code < kCodes && x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16))
    r = get(index, code);
  if (!r) return blocked_weight::python_geared_linear(x, index, out_features);
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  if (code == kFull) return run_full(*r, xc, out_features);
  const auto& t = r->t;
  if (code == kInt4 || code == kInt8) {
    // rows the tier hands to the layer's own weight (prompts): its GEMM here, where registered
    const at::Tensor& rows = *t[code == kInt4 ? 5 : 2];
    if (blocked_weight::routed_row_code(xc, rows, set_flag()) == 2) {
      if (const auto full = get(index, kFull)) return run_full(*full, xc, out_features);
    }
  }
  if (code == kFp16) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("vllm_adaptive_native::geared_fp16_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, const at::Tensor&,
                              const at::Tensor&, int64_t, int64_t)>();
    return op.call(xc, *t[0], t[1], *t[2], set_flag(), index, out_features);
  }
  if (code == kInt4) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("vllm_adaptive_native::geared_int4_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, const at::Tensor&,
                              const at::Tensor&, int64_t, int64_t)>();
    return op.call(xc, *t[0], *t[1], *t[2], t[3], t[4], r->group, *t[5], set_flag(), index,
                   out_features);
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("vllm_adaptive_native::geared_int8_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  return op.call(xc, *t[0], *t[1], *t[2], set_flag(), index, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_adaptive_native, m) {
  // registrations take no input tensor to dispatch on: one kernel for every backend
  m.def("geared_route_fp16(int index, Tensor packed, Tensor? fbgemm, Tensor native_rows) -> ()",
        &route_fp16);
  m.def(
      "geared_route_int4(int index, Tensor packed, Tensor scales, Tensor offsets, "
      "Tensor? int4pack, Tensor? int4pack_scale_zeros, int int4pack_group, Tensor native_rows) "
      "-> ()",
      &route_int4);
  m.def("geared_route_int8(int index, Tensor packed, Tensor scales, Tensor native_rows) -> ()",
        &route_int8);
  m.def("geared_route_full(int index, Tensor onednn_handler, Tensor? bias) -> ()", &route_full);
  m.def("geared_route_clear(int index) -> ()", &clear_routes);
  m.def("geared_linear_routed(Tensor x, Tensor uniform, int index, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_adaptive_native, CPU, m) {
  m.impl("geared_linear_routed", &geared_linear_routed);
}
