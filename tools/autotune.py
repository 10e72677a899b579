"""Autotune the compiled backends' kernel variants and write the table the backends read at run time.

    python tools/autotune.py                                   # standard DETR / DINO shapes, all dtypes
    python tools/autotune.py --presets detr_enc_bs2 --backends tma_ws --dtypes float16
    python tools/autotune.py --layouts --dtypes float16    # the head / channel layouts (LAYOUT_PRESETS)
    python tools/autotune.py --stale                       # entries measured on other kernel sources (no GPU)

For every (shape, dtype, backend, direction) it runs each compiled variant ("config") once on a
query subset against float64 and rejects every config that fails the accuracy rules or raises,
then times the survivors (CUDA-graph replays, rotated inputs) and keeps the best few. The result
is merged into mmdeform_tma/tuning_tables/<device>.json (or --table), with the GPU's compute
capability, so that GPUs without a table of their own use it too; 'auto' (per direction) and the
kernels' config choice follow it, at unmeasured shapes from the nearest measured one
(mmdeform_tma/tuning.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
from benchmark_op import DTYPES, LAYOUT_PRESETS, PRESETS, make_inputs, rel_l2  # noqa: E402

import mmdeform_tma  # noqa: E402
from mmdeform_tma import _extension, tuning  # noqa: E402
from mmdeform_tma.reference import ms_deform_attn_reference, ms_deform_attn_reference_backward  # noqa: E402

ops = torch.ops.mmdeform_tma
# The deterministic backward (fixed-point sums) of every config, a table direction of its own:
# calls under torch.use_deterministic_algorithms(True) read it (mmdeform_tma.tuning).
DETERMINISTIC = tuning.DETERMINISTIC_BACKWARD
# Inference-sized decoders (bs 1, 300 and 100 queries) too: there the kernels' start-up, not their
# loop, sets the time, and the nearest training-sized entry answered them wrongly (sweep s07, s39).
STANDARD_PRESETS = [
    "detr_enc_bs2", "detr_enc_bs8", "detr_dec_bs2", "dino_dec_bs2", "detr_enc_bs6_p8", "dino5_enc_bs2",
    "detr_dec_bs1", "detr_dec_bs1_q100",
]


# The files a backend's kernels are built from (beside setup.py's flags). Each entry records a
# digest of them, so that entries measured on other sources can be listed and re-tuned: the H100
# table's fp32 encoder forwards named configs that kernel changes had made 24-31 % slower than
# the fastest, for ten sessions (perf_notes.md, item 136).
BACKEND_SOURCES = {"tma_ws": ("hopper", "common"), "cuda": ("cuda", "common")}
REPO = Path(__file__).resolve().parent.parent


def sources_digest(backend: str, root: Path = REPO) -> str:
    """A digest of setup.py and the backend's source folders under mmdeform_tma/csrc."""
    csrc = root / "mmdeform_tma" / "csrc"
    files = [root / "setup.py"] + sorted(f for d in BACKEND_SOURCES[backend] for f in (csrc / d).rglob("*") if f.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def entry_sources(best: list[dict], measured: set[str], previous: dict, digest: str) -> str | None:
    """The digest of the sources every config an entry keeps was timed on, if one is known: this
    run's when it timed them all, else the earlier entry's when that was the same."""
    if all(b["config"] in measured for b in best) or previous.get("sources") == digest:
        return digest
    return None


def stale_report(table: dict, digests: dict[str, str]) -> list[str]:
    """The entries measured on other sources than `digests` (or before entries recorded theirs),
    per backend and direction, each with the command that re-tunes them."""
    stale = collections.defaultdict(list)
    for e in table["entries"]:
        if e.get("sources") != digests.get(e["backend"]):
            stale[(e["backend"], e["direction"])].append(e)
    count = sum(len(group) for group in stale.values())
    lines = [f"{table['device']}: {count} of {len(table['entries'])} entries measured on other kernel sources"]
    for (backend, direction), group in sorted(stale.items()):
        unrecorded = sum("sources" not in e for e in group)
        presets = sorted({e["preset"] for e in group})
        lines.append(f"  {backend} {direction}: {len(group)} ({unrecorded} before digests were recorded); re-tune with")
        lines.append(f"    python tools/autotune.py --backends {backend} --directions {direction} --presets {' '.join(presets)}")
    return lines


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def accurate(dtype: torch.dtype, err: float, rounding: float) -> bool:
    return err <= (1.5 * rounding + 1e-12 if dtype in (torch.float16, torch.bfloat16) else 1e-5)


class Checker:
    """The float64 answers on a query subset, computed once and compared with every config.

    The subset is the first `queries` queries of every batch element, except for encoder
    self-attention (as many queries as keys): there it is every query of the first element, so that
    the kernels take the pixel-block tiles they are timed on, not the strips of a query subset."""

    def __init__(self, inputs, queries: int):
        value, shapes_t, starts, loc, attn = inputs
        if loc.shape[1] == value.shape[1]:
            value, loc, attn = value[:1], loc[:1], attn[:1]
        else:
            loc, attn = loc[:, :queries].contiguous(), attn[:, :queries].contiguous()
        self.args = (value, shapes_t, starts, loc, attn)
        value, shapes_t, _, loc, attn = self.args
        g = torch.Generator(value.device).manual_seed(3)
        self.exact = ms_deform_attn_reference(value.double(), shapes_t, loc.double(), attn.double())
        self.grad = torch.randn(self.exact.shape, device=value.device, generator=g).to(value.dtype)
        self.exact_grads = ms_deform_attn_reference_backward(self.grad.double(), value.double(), shapes_t, loc.double(), attn.double())

    def problem(self, backend: str, direction: str, config: int) -> str | None:
        """None when the config computes the right result, else why not."""
        dtype = self.args[0].dtype
        try:
            if direction == "forward":
                out = ops.ms_deform_attn_forward(*self.args, backend, config)
                err, rounding = rel_l2(out, self.exact), rel_l2(self.exact.to(dtype), self.exact)
                return None if accurate(dtype, err, rounding) else f"output error {err:.2e}"
            got = ops.ms_deform_attn_backward(self.grad, *self.args, backend, config, False)
            want = self.exact_grads
            err, rounding = rel_l2(got[0], want[0]), rel_l2(want[0].to(dtype), want[0])
            if not accurate(dtype, err, rounding):
                return f"grad_value error {err:.2e}"
            err = rel_l2(got[2], want[2])
            return None if err <= 1e-4 else f"grad_weights error {err:.2e}"
        except RuntimeError as exc:
            return f"raised {str(exc).splitlines()[0][:100]}"


def config_calls(backend: str, direction: str, config: int, input_sets: list) -> list:
    g = torch.Generator(device=input_sets[0][0].device).manual_seed(5)
    deterministic = direction == DETERMINISTIC
    calls = []
    for value, shapes_t, starts, loc, attn in input_sets:
        if direction == "forward":
            calls.append(lambda v=value, s=shapes_t, st=starts, l=loc, a=attn: ops.ms_deform_attn_forward(v, s, st, l, a, backend, config))
        else:
            grad = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device=value.device, dtype=value.dtype, generator=g)
            calls.append(
                lambda gr=grad, v=value, s=shapes_t, st=starts, l=loc, a=attn: ops.ms_deform_attn_backward(
                    gr, v, s, st, l, a, backend, config, deterministic
                )
            )
    return calls


def best_configs(timed: list[dict], previous: list[dict], keep: int, partial: bool) -> list[dict]:
    """The entry's fastest configs: this run's, and with a partial run (--configs) also the earlier
    times of the configs it did not measure."""
    best = [{"config": r["config"], "ms": round(r["median_ms"], 5)} for r in timed]
    if partial:
        measured = {b["config"] for b in best}
        best += [b for b in previous if b["config"] not in measured]
    return sorted(best, key=lambda b: b["ms"])[:keep]


def presets_to_tune(presets: list[str] | None, layouts: bool) -> list[str]:
    """--presets (default: the DETR / DINO presets, unless --layouts alone), then with --layouts
    the head / channel layouts not named already."""
    chosen = list(presets) if presets is not None else ([] if layouts else list(STANDARD_PRESETS))
    return chosen + [name for name in LAYOUT_PRESETS if layouts and name not in chosen]


def save(table: dict, entries: dict, table_path: Path, report_path: Path, env: dict, report: list) -> None:
    """Merge the measured entries into the table and write it, with the report of every config."""
    table["capability"] = list(torch.cuda.get_device_capability())
    table["entries"] = sorted(entries.values(), key=lambda e: (e["key"], e["backend"], e["direction"]))
    table["updated"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    table["commit"] = env["commit"]
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    bench_common.write_json(report_path, {"environment": env, "runs": report})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="*", choices=list(PRESETS), default=None, help="default: the DETR / DINO presets")
    p.add_argument(
        "--layouts", action="store_true",
        help="tune the head / channel layouts of LAYOUT_PRESETS (beside --presets, if given)",
    )
    p.add_argument("--backends", nargs="*", default=["cuda", "tma_ws"])
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--directions", nargs="*", choices=["forward", "backward", DETERMINISTIC], default=["forward", "backward"])
    p.add_argument("--keep", type=int, default=3, help="configs kept per entry")
    p.add_argument(
        "--configs", nargs="*",
        help="time only these configs (by name); the table keeps the earlier times of the others",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check-queries", type=int, default=512, help="queries a batch element checked (not on encoders)")
    p.add_argument("--table", type=Path, help="table to merge into (default: the package's table for this GPU)")
    p.add_argument("--report", type=Path, default=Path("bench_results/autotune.json"))
    p.add_argument(
        "--stale", action="store_true",
        help="list the entries of --table (default: every table) measured on other kernel sources, and exit",
    )
    args = p.parse_args(argv)
    args.presets = presets_to_tune(args.presets, args.layouts)
    digests = {backend: sources_digest(backend) for backend in BACKEND_SOURCES}
    if args.stale:
        for path in [args.table] if args.table else sorted(tuning.TABLE_DIR.glob("*.json")):
            print("\n".join(stale_report(json.loads(path.read_text()), digests)))
        return 0
    if not torch.cuda.is_available():
        print("autotune needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    table_path = args.table or tuning.TABLE_DIR / f"{device_slug(name)}.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {"format": tuning.TABLE_FORMAT, "device": name, "entries": []}
    entries = {(e["key"], e["backend"], e["direction"]): e for e in table["entries"]}
    env = bench_common.environment(device)
    report = []

    for preset in args.presets:
        shape = PRESETS[preset]
        for dtype in (DTYPES[d] for d in args.dtypes):
            input_sets = [make_inputs(shape, dtype, "local", device, seed) for seed in range(3)]
            checker = Checker(input_sets[0], args.check_queries)
            v, s, st, l, a = input_sets[0]
            inputs = mmdeform_tma.inputs.validate(v, s, st, l, a)
            key = tuning.inputs_key(inputs)
            for backend in args.backends:
                reasons = mmdeform_tma.get_backend(backend).not_supported_reasons(inputs)
                if reasons:
                    print(f"{preset} {dtype} {backend}: skipped ({reasons[0]})")
                    continue
                for direction in args.directions:
                    results = []
                    listed = tuning.kernel_direction(direction)
                    for index, config_name in enumerate(_extension.kernel_configs(backend, listed)):
                        if args.configs and config_name not in args.configs:
                            continue
                        problem = checker.problem(backend, listed, index)
                        if problem:
                            results.append({"config": config_name, "rejected": problem})
                            continue
                        samples, mode = bench_common.time_calls(device, config_calls(backend, direction, index, input_sets), args.warmup, args.iters)
                        results.append({"config": config_name, **bench_common.summarize(samples), "timing": mode})
                    timed = sorted((r for r in results if "median_ms" in r), key=lambda r: r["median_ms"])
                    if timed:
                        previous = entries.get((key, backend, direction), {})
                        best = best_configs(timed, previous.get("best", []), args.keep, bool(args.configs))
                        entry = {"key": key, "backend": backend, "direction": direction, "preset": preset, "best": best}
                        sources = entry_sources(best, {r["config"] for r in timed}, previous, digests[backend])
                        entries[(key, backend, direction)] = {**entry, "sources": sources} if sources else entry
                    default = next((r for r in results if r["config"] == _extension.kernel_configs(backend, listed)[0]), {})
                    best = timed[0] if timed else {}
                    print(
                        f"{preset:>16} {str(dtype)[6:]:>8} {backend:>6} {direction:>8}: best {best.get('config')} "
                        f"{best.get('median_ms', float('nan')):.4f} ms (default {default.get('median_ms', float('nan')):.4f} ms), "
                        f"{sum('rejected' in r for r in results)} rejected of {len(results)}"
                    )
                    report.append({"preset": preset, "dtype": str(dtype), "backend": backend, "direction": direction, "key": key, "results": results})
            # after every shape and dtype, so that a run cut short keeps what it measured
            save(table, entries, table_path, args.report, env, report)

    save(table, entries, table_path, args.report, env, report)
    print(f"wrote {table_path} ({len(table['entries'])} entries) and {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
