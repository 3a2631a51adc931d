"""`edge-runtime bench` wiring: a flag of another benchmark is refused with its owner named, not ignored."""
import pytest

from edge_cli.main import main


@pytest.mark.parametrize("argv, flag, owner", [
    (["bench", "kv", "--questions", "3"], "--questions", "spec"),
    (["bench", "report", "--tree-size", "7"], "--tree-size", "spec"),
    (["bench", "spec", "--serve-requests", "2"], "--serve-requests", "serve"),
    (["bench", "decode", "--cache-pairs", "4"], "--cache-pairs", "cache"),
])
def test_a_flag_of_another_benchmark_is_refused(argv, flag, owner):
    with pytest.raises(SystemExit, match=f"{flag} applies to `bench {owner}` only"):
        main(argv)
