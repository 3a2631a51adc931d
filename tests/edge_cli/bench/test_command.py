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


def test_bench_decode_refuses_an_unknown_backend_or_an_isa_this_cpu_cannot_run(capsys):
    """`--backends native@ISA` runs the native backend with its integer kernels held to ISA (the same run
    can then compare variants); a name it does not know, or a variant this CPU lacks, is a one-line error
    before any worker starts."""
    from kernels import cpu_gemv, cpu_qgemm

    assert main(["bench", "decode", "--backends", "native,vllm"]) == 2
    assert "--backends takes a comma-separated list" in capsys.readouterr().err
    if not cpu_gemv.available():
        pytest.skip(cpu_gemv.unavailable_reason() or "no kernels")
    missing = [v for v in cpu_qgemm.VARIANTS if v not in cpu_qgemm.supported()]  # x86 lacks neon, arm64 avx2
    assert main(["bench", "decode", "--backends", f"native@{missing[0]}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot run the '{missing[0]}' kernels" in err and "portable" in err
