"""The per-request gear record the vLLM runtime and the MLX adapter share."""

from vllm_adaptive.gears import LEVEL_NAMES
from vllm_adaptive.precision.records import CODE_NAMES, decode_shifts, gear_record

LOW, HIGH, OFF = 0, len(LEVEL_NAMES) - 1, len(CODE_NAMES) - 1


def test_prompt_step_is_not_a_shift() -> None:
    # the prompt ran at the high gear, every decode step at the low one: no shift
    assert decode_shifts([HIGH, LOW, LOW, LOW]) == 0
    assert decode_shifts([HIGH, LOW, HIGH, HIGH, LOW]) == 2
    assert decode_shifts([LOW]) == 0 and decode_shifts([]) == 0


def test_record_counts_and_names() -> None:
    rec = gear_record("r1", 7, [HIGH, LOW, LOW, OFF], [1.0, 2.0, 3.0, 6.0], pinned=None)
    assert rec["prompt_tokens"] == 7 and rec["generated_tokens"] == 4
    assert rec["gear_tokens"][LEVEL_NAMES[LOW]] == 2 and rec["gear_tokens"]["off"] == 1
    assert sum(rec["gear_tokens"].values()) == 4
    assert rec["shifts"] == 1 and rec["mean_entropy_bits"] == 3.0
    assert rec["gears"] == [LEVEL_NAMES[HIGH], LEVEL_NAMES[LOW], LEVEL_NAMES[LOW], "off"]
    assert rec["pinned"] is None
    pinned = gear_record("r2", 3, [LOW, LOW], [], pinned=LOW)
    assert pinned["pinned"] == LEVEL_NAMES[LOW] and pinned["mean_entropy_bits"] is None
