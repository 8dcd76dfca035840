"""The weight-sync fingerprint on one device, against a device-to-device copy of the same bytes.

    7B-shaped bf16 weights (random, ~15.2 GB) in bucket-sized buffers on the device
        ──Fingerprint.update per buffer, hexdigest──>   timed (what each side of a sync adds)
        ──copy_ into a second buffer per buffer──>       timed (baseline: a transfer at memory speed)

A device-to-device copy moves bytes at memory speed, several times faster than
any link between GPUs, so `checksum_cost_vs_d2d_copy` is a pessimistic bound on
the fingerprint's cost relative to a transfer; the sync's own figure, with the
fingerprint overlapping the broadcasts, is `checksum_cost_vs_transfer` of
`bench/weight_sync.py --checksum-cost` (two GPUs). Also checks that one flipped
bit changes the fingerprint.

    python bench/checksum.py            # the GPU, 7B-shaped
    python bench/checksum.py --smoke    # CPU, 64 MiB, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, 64 MiB")
    parser.add_argument("--gb", type=float, default=15.23, help="bytes to fingerprint, GB (default: Qwen2-7B in bf16)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="cluster.weight_sync_bucket_mb")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    from dockyard.weights.fingerprint import Fingerprint

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.gb, args.bucket_mb, args.repeats = 64 * 2**20 / 1e9, 8, 3
    bucket = args.bucket_mb * 2**20
    count = max(1, int(args.gb * 1e9 // bucket))
    gen = torch.Generator(device=device).manual_seed(0)
    buffers = [torch.randint(0, 256, (bucket,), dtype=torch.uint8, device=device, generator=gen) for _ in range(count)]
    copies = [torch.empty_like(b) for b in buffers]
    nbytes = count * bucket

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(run) -> float:
        times = []
        for i in range(args.repeats + 1):
            sync()
            start = time.perf_counter()
            run()
            sync()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def fingerprint() -> str:
        f = Fingerprint()
        for b in buffers:
            f.update(b)
        return f.hexdigest()

    def copy() -> None:
        for src, dst in zip(buffers, copies, strict=True):
            dst.copy_(src)

    took_fp, took_copy = timed(fingerprint), timed(copy)
    before = fingerprint()
    buffers[count // 2][bucket // 3] ^= 1 << 5
    caught = fingerprint() != before
    gb = nbytes / 1e9
    print(f"device {device}, {gb:.2f} GB in {count} buffers of {args.bucket_mb} MiB")
    print(f"fingerprint:               {took_fp * 1e3:9.2f} ms  {gb / took_fp:8.1f} GB/s")
    print(f"device-to-device copy:     {took_copy * 1e3:9.2f} ms  {gb / took_copy:8.1f} GB/s")
    print(f"one flipped bit changes the fingerprint: {caught}")
    if not caught:
        sys.exit("a flipped bit went unseen")
    print(f"checksum_cost_vs_d2d_copy: {took_fp / took_copy:.3f}")


if __name__ == "__main__":
    main()
