"""--help explains every flag and shows its default; bad values are usage errors (exit 2)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from torch_qmm.__main__ import SUBCOMMANDS, main


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_flag_has_help_and_shows_its_default(command):
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and len(action.help) > 10, f"{command} {name} has no help"
        if action.option_strings and action.default not in (None, False):
            assert "default" in action.help, f"{command} {name}: default {action.default!r} not shown"


def test_convert_help_says_what_it_does_with_gguf(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "A llama-family GGUF file keeps its quantization" in text and "--requantize" in text
    assert "(default: the mode's, 4 for affine; for GGUF only with --requantize)" in " ".join(text.split())


def test_selftest_help_shows_how_to_run_a_smaller_set(capsys):
    with pytest.raises(SystemExit) as e:
        main(["selftest", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "selftest --device metalsim --bits 4 --group-sizes 64 --dtypes float16" in text
    assert "--bits / --group-sizes / --dtypes / --routes narrow it" in text


@pytest.mark.parametrize("argv", [["demo", "--bits", "7"], ["demo", "--tokens", "0"], ["demo", "--group-size", "48"],
                                  ["convert", "a", "b", "--format", "onnx"], ["inspect"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_quantize_summary_and_progress_when_nothing_is_quantized(capsys):
    import torch

    from torch_qmm.convert import quantize_model

    summary = quantize_model(torch.nn.Sequential(torch.nn.ReLU()), progress=True)
    assert "nan" not in str(summary) and str(summary).startswith("0 linear layers quantized")
    assert "0layer" not in capsys.readouterr().err  # no empty progress bar


@pytest.mark.parametrize("argv, usage, hint", [
    (["convert", "src", "dst", "--groupsize", "64"], "python -m torch_qmm convert", "--groupsize: did you mean --group-size?"),
    (["convert", "src", "dst", "--dtpye=float16"], "python -m torch_qmm convert", "--dtpye: did you mean --dtype?"),
    (["inspect", "f.gguf", "--jsn"], "python -m torch_qmm inspect", "--jsn: did you mean --json?"),
    (["bench", "--qiuck"], "python -m torch_qmm bench", "--qiuck: did you mean --quick?"),
    (["convert", "src", "dst", "extra"], "python -m torch_qmm convert", "unrecognized arguments: extra"),
])
def test_a_mistyped_option_is_named_by_its_subcommand_with_the_option_meant(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    # The subcommand's usage (its options), not the top level's list of subcommands.
    assert err.startswith(f"usage: {usage}") and "{selftest,demo" not in err
    assert hint in err.splitlines()[-1]
