"""A webhook target to watch deliveries arrive: prints each POST and answers 200.

    python3 examples/receiver.py            # listens on 127.0.0.1:9000
    python3 examples/receiver.py 9001       # or on another port

examples/justonce.toml delivers to http://127.0.0.1:9000/hooks/<source>.
"""

import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        key = self.headers.get("Idempotency-Key")
        print(f"{self.path} Idempotency-Key: {key} {body.decode(errors='replace')}", flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
HTTPServer(("127.0.0.1", port), Receiver).serve_forever()
