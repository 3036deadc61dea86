"""Loading a real-size checkpoint: host memory and time, side by side (CPU): `python bench/load.py`.

Builds (once) a random Qwen2-VL-2B-Instruct checkpoint (`mmserve.loadgen.checkpoints.qwen2_vl_2b`,
bf16 on disk, 2.2B parameters) and loads it, each in a fresh process, as an LLM replica does
(`llm_service.model.LanguageModel`: the language model only), as an encoder replica does
(`encoder_service.runtime.VisionEncoder`: the vision tower only), and as `transformers` does
(`from_pretrained` of the whole model), in each dtype asked for. For each: the weights' bytes in
memory, the peak growth of the process's resident memory while loading (Linux VmHWM, reset just
before the load, minus the RSS then), their ratio, and the seconds. The target of the issue that
made this bench: an mmserve half at <= 1.3x its weights. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("llm", "encoder", "transformers")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _param_bytes(module) -> int:
    storages = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in module.parameters()}
    return sum(storages.values())


def child(role: str, dtype: str, model_dir: str) -> dict:
    """One load in this (fresh) process."""
    import torch  # noqa: F401  (imported before the baseline RSS, as every role needs it)
    from transformers import AutoModelForImageTextToText

    from encoder_service.runtime import VisionEncoder
    from llm_service.model import LanguageModel

    rss = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    if role == "llm":
        module = LanguageModel(model_dir, dtype=dtype).modules
    elif role == "encoder":
        module = VisionEncoder(model_dir, dtype=dtype).tower
    else:
        module = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    weights = _param_bytes(module)
    peak = _status("VmHWM") - rss
    return {"role": role, "dtype": dtype, "weights_gb": weights / 1e9, "peak_growth_gb": peak / 1e9,
            "peak_over_weights": peak / weights, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint to load (default: build the random Qwen2-VL-2B)")
    parser.add_argument("--text-layers", type=int, help="shrink the built checkpoint's language model")
    parser.add_argument("--vision-depth", type=int, help="shrink the built checkpoint's vision tower")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated load dtypes")
    parser.add_argument("--roles", default=",".join(ROLES), help=f"comma-separated, of {', '.join(ROLES)}")
    parser.add_argument("--child", nargs=3, metavar=("ROLE", "DTYPE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    model = args.model
    if model is None:
        from mmserve.loadgen.checkpoints import qwen2_vl_2b

        name = f"mmserve-bench-qwen2_vl_2b-{args.text_layers or 'all'}-{args.vision_depth or 'all'}"
        print(f"[load] building (once) the random Qwen2-VL-2B checkpoint in {tempfile.gettempdir()}/{name}",
              flush=True)
        model = qwen2_vl_2b(Path(tempfile.gettempdir()) / name, text_layers=args.text_layers,
                            vision_depth=args.vision_depth)
    rows = []
    for dtype in args.dtypes.split(","):
        for role in args.roles.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", role, dtype, model], capture_output=True,
                                 text=True, check=False)
            if out.returncode:
                raise SystemExit(f"{role} {dtype} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['role']:>12} {r['dtype']:>9}  weights {r['weights_gb']:6.2f} GB  peak +{r['peak_growth_gb']:6.2f} GB"
                  f"  {r['peak_over_weights']:5.2f}x  {r['seconds']:6.1f}s", flush=True)
    worst = max(r["peak_over_weights"] for r in rows if r["role"] != "transformers")
    print(f"worst mmserve half: peak {worst:.2f}x its weights (target <= 1.3x)")
    print(json.dumps({"model": model, "rows": rows, "worst_mmserve_peak_over_weights": worst}))


if __name__ == "__main__":
    main()
