"""A small inference server inside the gpumgr grant: POST a batch, get the model's output.

    python serve.py [--port 8000] [--width 2048] [--memory BYTES]
    curl -s localhost:8000 -d '{"inputs": [[0.1, 0.2, ...512 numbers...]]}'   # {"outputs": [[...10...]]}

Plain ``http.server`` and plain PyTorch, nothing downloaded: the model's weights are random. The
caching allocator is capped from ``GPUMGR_GPU_MEMORY`` first (see ``grant.py``), so a request too large
for the grant is answered 507 and the server lives on, instead of the container being killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grant

INPUTS = 512
OUTPUTS = 10
#: The largest body a request may send, and the most rows one may ask for.
MAX_BODY = 8 << 20
MAX_ROWS = 4096


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--width", type=int, default=2048, help="hidden units of the model")
    parser.add_argument("--memory", type=int, help="bytes the allocator may use (default: GPUMGR_GPU_MEMORY)")
    return parser.parse_args(argv)


def rows_of(body: bytes) -> list[list[float]]:
    """The request's ``inputs``: 1..MAX_ROWS rows of INPUTS numbers each; ValueError says what is wrong."""
    data = json.loads(body)
    rows = data.get("inputs") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_ROWS:
        raise ValueError(f'send {{"inputs": [[...{INPUTS} numbers...], ...]}} with 1 to {MAX_ROWS} rows')
    if any(not isinstance(r, list) or len(r) != INPUTS or not all(isinstance(x, int | float) for x in r)
           for r in rows):
        raise ValueError(f"every row must hold {INPUTS} numbers")
    return rows


def handler(predict: Any, out_of_memory: type[BaseException]) -> type[BaseHTTPRequestHandler]:
    """The request handler around ``predict`` (rows → rows), answering JSON."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200, {"status": "ok"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                return self._answer(413 if length else 400, {"error": f"send a JSON body of at most {MAX_BODY} bytes"})
            try:
                outputs = predict(rows_of(self.rfile.read(length)))
            except (ValueError, json.JSONDecodeError) as exc:
                return self._answer(400, {"error": str(exc)})
            except out_of_memory:
                return self._answer(507, {"error": "this batch does not fit in the container's GPU memory grant"})
            return self._answer(200, {"outputs": outputs})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch  # after the arguments, so --help works without PyTorch

    if not torch.cuda.is_available():
        print("no CUDA device is visible", file=sys.stderr)
        return 2
    fraction = grant.cap_allocator(torch, 0, args.memory)
    print(f"allocator capped at {fraction:.4f} of the GPU" if fraction else "no grant found: allocator not capped",
          flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, args.width), torch.nn.GELU(),
                                torch.nn.Linear(args.width, OUTPUTS)).to("cuda").eval()
    lock = threading.Lock()  # one batch on the GPU at a time: the grant is sized for one

    def predict(rows: list[list[float]]) -> list[list[float]]:
        with lock, torch.inference_mode():
            try:
                result = model(torch.tensor(rows, device="cuda")).float().cpu().tolist()
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                raise
        return [[round(x, 6) for x in row] for row in result]

    server = ThreadingHTTPServer((args.host, args.port), handler(predict, torch.OutOfMemoryError))
    print(f"serving on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
