"""Command-line errors are one line each: argparse's own (a bad choice, a bad type, a missing
required flag, an unknown command) name the command's ``--help`` instead of printing the usage;
``chat``'s ``/stats`` after ``/reset`` shows the reset state; an unknown ``/command`` says so."""

from __future__ import annotations

import io

import pytest

from mlxformer.cli import main
from mlxformer.cli.chat import run_repl


@pytest.mark.parametrize("argv,expected", [
    (["generate", "-p", "hi", "--temp", "warm"],
     "mlxformer generate: error: argument --temp: invalid float value: 'warm' (see 'mlxformer generate --help')"),
    (["generate", "-p", "hi", "--dtype", "int4"],
     "mlxformer generate: error: argument --dtype: invalid choice: 'int4' (choose from 'bfloat16', 'float16', "
     "'float32') (see 'mlxformer generate --help')"),
    (["generate"], "mlxformer generate: error: the following arguments are required: --prompt/-p "
                   "(see 'mlxformer generate --help')"),
    (["serve", "--port", "http"],
     "mlxformer serve: error: argument --port: invalid int value: 'http' (see 'mlxformer serve --help')"),
    (["frobnicate"], "mlxformer: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["generate", "-p", "hi", "--tempreature", "0"],
     "mlxformer generate: error: unrecognized arguments: --tempreature 0 (see 'mlxformer generate --help')"),
    (["serve", "--prot", "80"],
     "mlxformer serve: error: unrecognized arguments: --prot 80 (see 'mlxformer serve --help')"),
])
def test_argparse_errors_are_one_line_with_a_hint(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(expected) and err.rstrip().endswith("--help')")


@pytest.fixture(scope="module")
def session(tiny_smol):
    from mlxformer import load
    from mlxformer.generation.chat import ChatSession

    model, tokenizer = load(tiny_smol[0])
    return ChatSession(model, tokenizer, max_tokens=3)


def test_stats_after_reset_shows_the_reset_state(session):
    out = io.StringIO()
    run_repl(session, io.StringIO("Hello\n/stats\n/reset\n/stats\n"), out)
    stats = [line for line in out.getvalue().splitlines() if line.startswith("context:")]
    assert len(stats) == 2
    assert not stats[0].startswith("context: 0 tokens") and "last prefill: 0 tokens" not in stats[0]
    assert stats[1] == "context: 0 tokens | cache: 0.00 MB | last prefill: 0 tokens"


def test_unknown_command_says_so(session):
    out = io.StringIO()
    run_repl(session, io.StringIO("/frobnicate now\n/help\n"), out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("unknown command /frobnicate; commands: /reset")
    assert lines[1].startswith("commands: /reset")
