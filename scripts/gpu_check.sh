#!/usr/bin/env bash
# The GPU checks that fit one call of a lent device machine (one H100/H200; torch and Triton
# installed, no SGLang, no network: SGLang's CUDA stack, ~11 GB, cannot travel there). Run from
# the repository root, e.g. through the device tool:  bash scripts/gpu_check.sh
# It checks what runs without SGLang and writes everything under $OUT (default /tmp/gpu_check):
#   env.txt         the device, driver, torch and Triton versions
#   tests.txt       core's tests on the machine (the Triton decode kernel on CUDA against the
#                   torch reference, rope, attention, content chunks; no server tests)
#   decode.jsonl    one decode step's attention over rows reading Masters at a shift, at a
#                   served shape: the Triton kernel against the torch tiles and against SDPA over
#                   per-row copies (what SGLang's own decode reads), milliseconds per step
# A few minutes. The server, demo and benchmarks need SGLang's GPU install (scripts/setup_gpu.sh)
# on a machine that can reach the package registries.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/gpu_check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi; "$PYTHON" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
  "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")'; } \
  2>&1 | tee "$OUT/env.txt"
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || { echo "no CUDA device"; exit 1; }

# conftest.py starts SGLang servers: core's tests need none of it
"$PYTHON" -m pytest -q --noconftest -p no:cacheprovider test/test_rope_attention.py test/test_rope.py \
  test/test_attention.py test/test_content_chunks.py 2>&1 | tee "$OUT/tests.txt"
status=${PIPESTATUS[0]}

"$PYTHON" - "$OUT/decode.jsonl" <<'EOF' 2>&1 | tee "$OUT/decode.txt"
import json, sys, torch
import torch.nn.functional as F
from sglang_tokendance.core.rope import RopeSpec
from sglang_tokendance.core.rope_attention import (ShiftedReads, decode_tiles, tiled_decode_attention,
                                                   tiled_decode_attention_triton)
from sglang_tokendance.core.slot_frames import SlotFrames

dev, dtype = torch.device("cuda"), torch.bfloat16
heads, kv_heads, d, scale = 32, 8, 128, 128 ** -0.5
spec = RopeSpec(d, d, 500000.0)
rows_out = []
for batch, length, shared in ((16, 2048, 1536), (64, 4096, 3072)):
    own = length - shared
    slots = shared + batch * own + 1
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(slots, kv_heads, d, device=dev, generator=g, dtype=dtype)
    values = torch.randn(slots, kv_heads, d, device=dev, generator=g, dtype=dtype)
    frames = SlotFrames(slots, device=dev)
    table = torch.zeros(batch + 1, length, dtype=torch.int32, device=dev)
    master = torch.arange(1, shared + 1, device=dev)
    frames.record(master, torch.arange(shared, device=dev) + 7)  # its author wrote it 7 tokens later
    for b in range(batch):  # own prefix, then the Master read at a shift, then own text
        mine = 1 + shared + b * own + torch.arange(own, device=dev)
        head = own // 2
        table[b + 1] = torch.cat([mine[:head], master, mine[head:]]).to(torch.int32)
        frames.record(mine, torch.cat([torch.arange(head), torch.arange(head + shared, length)]).to(dev))
    row_index = torch.arange(1, batch + 1, device=dev)
    reads = ShiftedReads(spec, frames)
    q = torch.randn(batch, heads, d, device=dev, generator=g, dtype=dtype)
    tiles = decode_tiles(table, row_index, [length] * batch, reads)

    def copies():  # what each row would hold as its own copies, K turned from its frames to the row's positions
        ks = torch.stack([reads.shift_(keys[table[b + 1].long()].float(), reads.shifts(table[b + 1:b + 2].long())[0])
                          for b in range(batch)]).to(dtype)
        vs = torch.stack([values[table[b + 1].long()] for b in range(batch)])
        return ks.transpose(1, 2), vs.transpose(1, 2)

    ks, vs = copies()

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], ks, vs, scale=scale, enable_gqa=True)[:, :, 0]

    def timed(fn, n=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    ref = tiled_decode_attention(q, keys, values, tiles, scale, reads).float()
    tri = tiled_decode_attention_triton(q, keys, values, tiles, scale, reads).float()
    row = {"batch": batch, "length": length, "shared": shared,
           "max_abs_diff_triton_vs_torch": float((tri - ref).abs().max()),
           "max_abs_diff_triton_vs_copies": float((tri - sdpa().float()).abs().max()),
           "triton_ms": timed(lambda: tiled_decode_attention_triton(q, keys, values, tiles, scale, reads)),
           "torch_tiles_ms": timed(lambda: tiled_decode_attention(q, keys, values, tiles, scale, reads)),
           "sdpa_copies_ms": timed(sdpa)}
    print(row)
    rows_out.append(row)
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows_out)
EOF
bench=${PIPESTATUS[0]}
echo "tests exit $status, decode benchmark exit $bench"
exit $(( status || bench ))
