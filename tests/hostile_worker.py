"""Runs hostile-file cases in a fresh process and reports, per case, how it ended, how long it
took and how much memory it needed (used by test_hostile_files.py; not a test module).

    python hostile_worker.py CASES.json RESULTS.json

CASES.json: {"base": {kind: path of the valid file or folder}, "time_limit": s, "max_converts": n,
"cases": [case]};
a case is {"id", "kind": "gguf" | "mlx", "file": the file of the base to mutate ("" for a GGUF),
"patches": [[offset, hex bytes]], "truncate": length or null, "text": replacement text or null}.
Each case copies the base, applies its mutation, then runs what a user would run on it: for a
GGUF file GGUFFile (metadata, every tensor decoded), the llama metadata check, `inspect` and
`convert --format mlx` (for the first max_converts accepted files); for an MLX folder load_mlx into the model of the intact folder and
`inspect`. Outcome: "accepted", "refused" (a ValueError naming the file, or exit code 1 with one
line naming it), or "bad: ..." (anything else). Time is limited per case with SIGALRM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


class CaseTimeout(BaseException):  # not an Exception: the CLI's error handler must not catch it
    pass


def _alarm(signum, frame):
    raise CaseTimeout()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cli(main, argv: list[str], path: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    lines = [line for line in err.getvalue().splitlines() if line.strip() and "it/s]" not in line
             and "tensor/s]" not in line and "%|" not in line]
    if rc == 0:
        return "accepted"
    if rc == 1 and len(lines) == 1 and path in lines[0] and "unexpected" not in lines[0]:
        return "refused"
    return f"bad: {' '.join(argv[:1])} exit {rc}: {' | '.join(lines)[:300]}"


def _api(fn, path: str) -> str:
    try:
        fn()
    except ValueError as e:
        return "refused" if path in str(e) else f"bad: ValueError without the file name: {str(e)[:300]}"
    return "accepted"


def _gguf_case(path: Path, out: Path, convert: bool = True) -> list[str]:
    from torch_qmm.__main__ import main
    from torch_qmm.interop.gguf import GGUFFile, dequantize
    from torch_qmm.interop.gguf_llama import check_llama_metadata

    def read_all():
        f = GGUFFile(path)
        f.metadata
        for t in f.tensors.values():
            dequantize(t)
        check_llama_metadata(f)

    outcomes = [_api(read_all, str(path)), _cli(main, ["inspect", str(path)], str(path))]
    if outcomes[0] == "accepted" and convert:
        outcomes.append(_cli(main, ["convert", str(path), str(out), "--format", "mlx"], str(path)))
    return outcomes


def _mlx_case(folder: Path, template) -> list[str]:
    import copy

    from torch_qmm.__main__ import main
    from torch_qmm.interop import load_mlx

    model = copy.deepcopy(template)  # load_mlx replaces its layers
    return [_api(lambda: load_mlx(model, folder, progress=False), str(folder)),
            _cli(main, ["inspect", str(folder)], str(folder))]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import torch

    torch.set_num_threads(1)
    import transformers  # imported before the baseline is taken

    import torch_qmm.interop.cli_convert  # noqa: F401

    signal.signal(signal.SIGALRM, _alarm)
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    mlx_config = None
    if "mlx" in spec["base"]:
        config = json.loads((Path(spec["base"]["mlx"]) / "config.json").read_text())
        for k in ("quantization", "quantization_config", "architectures", "transformers_version", "model_type"):
            config.pop(k, None)
        mlx_config = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))  # the template model
    # Warm-up on the intact files: first-use imports (transformers' save path, ...) happen here,
    # outside the timed cases, and the intact files must be accepted.
    warm = work / "warm"
    warm.mkdir()
    intact = {}
    if "gguf" in spec["base"]:
        shutil.copyfile(spec["base"]["gguf"], warm / "m.gguf")
        intact["gguf"] = _gguf_case(warm / "m.gguf", warm / "out")
    if mlx_config is not None:
        intact["mlx"] = _mlx_case(Path(spec["base"]["mlx"]), mlx_config)
    shutil.rmtree(warm)
    results = {"baseline_rss_mb": _rss_mb(), "intact": intact, "cases": []}
    converts = 0  # full conversions of accepted GGUF mutants (the slow part), at most max_converts
    for case in spec["cases"]:
        base = Path(spec["base"][case["kind"]])
        target = work / ("m.gguf" if case["kind"] == "gguf" else "mlx")
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        shutil.rmtree(work / "out", ignore_errors=True)
        if base.is_dir():
            shutil.copytree(base, target)
        else:
            shutil.copyfile(base, target)
        victim = target / case["file"] if case["file"] else target
        if case.get("text") is not None:
            victim.write_text(case["text"])
        data = bytearray(victim.read_bytes())
        for offset, hexbytes in case.get("patches", []):
            patch = bytes.fromhex(hexbytes)
            data[offset:offset + len(patch)] = patch
        if case.get("truncate") is not None:
            del data[case["truncate"]:]
        victim.write_bytes(bytes(data))
        size = victim.stat().st_size
        tracemalloc.start()
        t0 = time.perf_counter()
        signal.alarm(spec["time_limit"])
        try:
            if case["kind"] == "gguf":
                outcomes = _gguf_case(target, work / "out", convert=converts < spec["max_converts"])
                converts += len(outcomes) == 3
            else:
                outcomes = _mlx_case(target, mlx_config)
        except CaseTimeout:
            outcomes = ["bad: time limit"]
        except MemoryError:
            outcomes = ["bad: MemoryError"]
        except Exception as e:  # the outcome to report: an exception no check caught
            outcomes = [f"bad: {type(e).__name__}: {str(e)[:300]}"]
        finally:
            signal.alarm(0)
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        results["cases"].append({"id": case["id"], "outcomes": outcomes, "seconds": seconds, "file_bytes": size,
                                 "traced_peak_bytes": peak, "rss_mb": _rss_mb()})
    shutil.rmtree(work, ignore_errors=True)
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
