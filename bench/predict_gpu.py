"""The dynamic batcher on a GPU: the predict worker alone, batch-1 vs the batcher, CUDA vs CPU.

The model is a small convolutional network for scikit-learn's 8x8 digits, trained here in a
few seconds and saved as TorchScript (the worker's ``torchscript`` framework); the worker is
the platform's own (``python -m serving.predict.worker --device cuda``), the clients are
plain HTTP clients of the Open Inference Protocol with binary tensors (one image each), in
several processes so that they are not what limits. Needs torch, scikit-learn, aiohttp and
the worker's packages (uvicorn, httptools, orjson, onnxruntime, numpy); no database, no Redis.

    python bench/predict_gpu.py --out DIR [--duration 5] [--devices cuda cpu]

Writes DIR/predict-gpu.json and DIR/predict-gpu.md (the table docs/performance.md quotes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIGNATURE = {
    "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
    ],
}
BATCHERS: dict[str, dict[str, Any]] = {
    "batcher": {"max_batch_size": 64, "max_queue_delay_us": 0, "preferred_batch_sizes": [16, 64]},
    "batch-1": {"max_batch_size": 1, "max_queue_delay_us": 0},
}
for _batcher in BATCHERS.values():
    _batcher["max_queue_size"] = 4096


def build_cnn(folder: Path, device: str) -> dict[str, Any]:
    """Train the CNN on a stratified three quarters of the digits; its accuracy on the rest."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(0)
    digits = load_digits()
    x = digits.data.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=0
    )

    class DigitsCNN(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            )  # fmt: skip
            self.head = torch.nn.Sequential(
                torch.nn.Flatten(), torch.nn.Linear(128 * 2 * 2, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
            )

        def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.head(self.features(pixels.reshape(-1, 1, 8, 8) / 16.0))
            probabilities = torch.softmax(logits, dim=1)
            return probabilities.argmax(dim=1), probabilities

    model = DigitsCNN().to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=2e-3)
    xs, ys = torch.from_numpy(x_train).to(device), torch.from_numpy(y_train).long().to(device)
    started = time.perf_counter()
    for _epoch in range(30):
        order = torch.randperm(len(xs), device=device)
        for i in range(0, len(xs), 64):
            batch = order[i : i + 64]
            logits = model.head(model.features(xs[batch].reshape(-1, 1, 8, 8) / 16.0))
            loss = torch.nn.functional.cross_entropy(logits, ys[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    with torch.inference_mode():
        labels, _ = model(torch.from_numpy(x_test).to(device))
    accuracy = float((labels.cpu().numpy() == y_test).mean())
    scripted = torch.jit.script(model.cpu())
    folder.mkdir(parents=True, exist_ok=True)
    scripted.save(str(folder / "model.pt"))
    return {
        "heldout_accuracy": round(accuracy, 4),
        "heldout_rows": len(y_test),
        "train_seconds": round(time.perf_counter() - started, 1),
        "example": x_test[0].tolist(),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(
    folder: Path, batcher: dict[str, Any], device: str, threads: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = {"signature": SIGNATURE, "batcher": batcher}
    command = [
        sys.executable, "-m", "serving.predict.worker", "--name", "digits-cnn", "--version", "1",
        "--artifact", str(folder), "--config", json.dumps(config), "--port", str(port),
        "--threads", str(threads), "--framework", "torchscript", "--device", device,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the worker ended ({process.returncode})")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as answer:
                if answer.status == 200:
                    return process, base
        except OSError:
            time.sleep(0.3)
    raise SystemExit("the worker did not become ready")


def _client(args: tuple[str, bytes, int, int, float, float, int]) -> tuple[int, list[float], int]:
    """One client process: ``connections`` closed-loop clients until ``stop`` (wall time);
    with ``parts`` > 1 each call carries that many predictions, as a gateway sends them
    (``MANY_PATH``). Returns (predictions answered, call latencies, failed calls)."""
    url, body, length, connections, start, stop, parts = args
    headers = {"content-type": "application/octet-stream", "inference-header-content-length": str(length)}
    if parts > 1:
        from serving.gateway.inference_protocol import MANY_PATH, Part, pack_many

        url = url.split("/v2/", 1)[0] + MANY_PATH
        body = pack_many([Part(0, str(length), body)] * parts)
        headers = {"content-type": "application/octet-stream"}

    async def run() -> tuple[int, list[float], int]:
        import aiohttp

        latencies: list[float] = []
        errors = 0
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def loop() -> None:
                nonlocal errors
                while time.time() < stop:
                    began = time.perf_counter()
                    async with session.post(url, data=body, headers=headers) as answer:
                        await answer.read()
                        if answer.status != 200:
                            errors += 1
                    if time.time() >= start:
                        latencies.append(time.perf_counter() - began)

            await asyncio.gather(*(loop() for _ in range(connections)))
        return len(latencies) * parts, latencies, errors

    return asyncio.run(run())


def measure(base: str, body: bytes, length: int, concurrency: int, duration: float, parts: int = 1) -> dict[str, Any]:
    processes = min(concurrency, 8)
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    before = json.loads(urllib.request.urlopen(f"{base}/stats", timeout=5).read())
    start = time.time() + 1.5  # every client running (and warm) before the counted second starts
    stop = start + duration
    url = f"{base}/v2/models/digits-cnn/infer"
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.map(_client, [(url, body, length, share, start, stop, parts) for share in shares])
    after = json.loads(urllib.request.urlopen(f"{base}/stats", timeout=5).read())
    latencies = sorted(latency for _, each, _ in results for latency in each)
    done = sum(answered for answered, _, _ in results)
    calls = len(latencies)
    sizes = {
        size: count - before["batch_sizes"].get(size, 0)
        for size, count in after["batch_sizes"].items()
        if count - before["batch_sizes"].get(size, 0) > 0
    }
    return {
        "concurrency": concurrency,
        "throughput_rps": round(done / duration, 1),
        "p50_ms": round(latencies[calls // 2] * 1000, 2) if calls else None,
        "p99_ms": round(latencies[min(calls - 1, int(calls * 0.99))] * 1000, 2) if calls else None,
        "errors": sum(e for _, _, e in results),
        "batch_sizes": sizes,
        "device": after.get("device"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    parser.add_argument(
        "--together", type=int, default=16,
        help="also measure calls of this many predictions each, as a gateway sends them (0: not)",
    )  # fmt: skip
    parser.add_argument("--cpu-threads", type=int, default=4, help="the CPU worker's threads (a slot's cores)")
    args = parser.parse_args()
    import numpy as np
    import torch

    from registry.signatures import Signature
    from serving.gateway.inference_protocol import encode_request

    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    folder = args.out / "digits-cnn"
    model = build_cnn(folder, "cuda" if gpu else "cpu")
    print(f"model: {model['heldout_accuracy']:.4f} on {model['heldout_rows']} held-out digits", flush=True)
    body, length = encode_request(
        {"pixels": np.asarray([model.pop("example")], dtype=np.float32)}, Signature.from_json(SIGNATURE)
    )
    rows: list[dict[str, Any]] = []
    for device in args.devices:
        if device == "cuda" and gpu is None:
            continue
        for side, batcher in BATCHERS.items():
            process, base = start_worker(folder, batcher, device, 1 if device == "cuda" else args.cpu_threads)
            try:
                for concurrency in args.concurrency:
                    row = {"device": device, "side": side, **measure(base, body, length, concurrency, args.duration)}
                    print(f"  {row}", flush=True)
                    rows.append(row)
                if args.together > 1:
                    # As many predictions in flight as at the largest concurrency, K to a call.
                    calls = max(1, max(args.concurrency) // args.together)
                    measured = measure(base, body, length, calls, args.duration, parts=args.together)
                    row = {"device": device, "side": f"{side}, {args.together} per call", **measured}
                    print(f"  {row}", flush=True)
                    rows.append(row)
            finally:
                process.terminate()
                process.wait(30)
    by = {(r["device"], r["side"], r["concurrency"]): r for r in rows}
    top = max(args.concurrency)
    ratios = {
        f"{device}: batcher / batch-1 throughput at {top} clients": round(
            by[(device, "batcher", top)]["throughput_rps"] / max(0.1, by[(device, "batch-1", top)]["throughput_rps"]), 2
        )
        for device in args.devices
        if (device, "batcher", top) in by and (device, "batch-1", top) in by
    }
    if args.together > 1:
        calls = max(1, top // args.together)
        for device in args.devices:
            together, alone = (device, f"batcher, {args.together} per call", calls), (device, "batch-1", top)
            if together in by and alone in by:
                name = f"{device}: batcher with {args.together} per call / batch-1 throughput, {top} in flight"
                ratios[name] = round(by[together]["throughput_rps"] / max(0.1, by[alone]["throughput_rps"]), 2)
    report = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": gpu,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "model": model,
        "duration_s": args.duration,
        "rows": rows,
        "ratios": ratios,
    }
    (args.out / "predict-gpu.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"GPU: {gpu}, torch {torch.__version__}, {os.cpu_count()} CPUs; {report['when']}; "
        f"model held-out accuracy {model['heldout_accuracy']}",
        "",
        "| device | side | clients | req/s | p50 ms | p99 ms | errors | batch sizes formed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sizes = ", ".join(f"{k}x{v}" for k, v in sorted(r["batch_sizes"].items(), key=lambda kv: int(kv[0])))
        lines.append(
            f"| {r['device']} | {r['side']} | {r['concurrency']} | {r['throughput_rps']} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['errors']} | {sizes} |"
        )
    lines += ["", *(f"- {name}: {value}x" for name, value in ratios.items())]
    (args.out / "predict-gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
