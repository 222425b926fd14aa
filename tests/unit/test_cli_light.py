"""The training commands run where only torch and transformers are installed (a GPU machine
lent without vLLM or pydantic): building the command line imports neither."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKED = r"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {BLOCK}:
            raise ImportError("blocked for this test: " + name)

sys.meta_path.insert(0, Block())
from vllm_adaptive import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _help(command: list[str], block: set[str]) -> subprocess.CompletedProcess:
    code = BLOCKED.replace("{BLOCK}", repr(block))
    return subprocess.run(
        [sys.executable, "-c", code, *command, "--help"], capture_output=True, text=True
    )


@pytest.mark.parametrize("command", [["train", "draft"], ["train", "m2r2"]])
def test_training_commands_need_no_vllm_and_no_pydantic(command: list[str]) -> None:
    done = _help(command, {"vllm", "pydantic"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: " in done.stdout and command[-1] in done.stdout


def test_the_block_is_real() -> None:
    """Negative control: a module the command line does import is refused by the same block."""
    done = _help(["train", "draft"], {"argparse"})
    assert done.returncode != 0 and "blocked for this test: argparse" in done.stderr
