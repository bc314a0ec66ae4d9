"""The Python consumer the bench holds justonce against: a message consumer written the
plain way, with psycopg and nothing else.

Per message: BEGIN, INSERT the key ON CONFLICT DO NOTHING, the effect row when the key was
new, COMMIT. The stream is the one `justonce bench` generates (same keys, same duplicates),
split between the workers as the bench splits it. Each worker is a process of its own with
one connection; they start together, and the run is timed from then until the last ends.

Prints one JSON object: messages, workers, seconds, messages_per_second, effects and
distinct keys. Exits non-zero when the effect rows are not one per distinct key.
"""

import argparse
import json
import multiprocessing
import time

import psycopg

KEYS = "peer_consumer_keys"
EFFECTS = "peer_consumer_effects"


def stream(messages, duplicates):
    """The keys `justonce bench` generates: `duplicates` percent repeat an earlier one."""
    keys = []
    distinct = 0
    for n in range(messages):
        if n > 0 and (n * 7_919) % 100 < duplicates:
            keys.append(keys[(n * 104_729) % n])
        else:
            keys.append(f"message:{distinct}")
            distinct += 1
    return keys, distinct


def consume(url, keys, ready):
    with psycopg.connect(url, autocommit=True) as conn:
        ready.wait()
        for key in keys:
            with conn.transaction():
                claimed = conn.execute(
                    f"INSERT INTO {KEYS} (key) VALUES (%s) ON CONFLICT DO NOTHING", (key,)
                )
                if claimed.rowcount == 1:
                    conn.execute(f"INSERT INTO {EFFECTS} (effect_key) VALUES (%s)", (key,))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", required=True)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--duplicates", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    with psycopg.connect(args.database, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {KEYS} ("
            " key text PRIMARY KEY,"
            " processed_at timestamptz NOT NULL DEFAULT now())"
        )
        # The same shape as the bench's effect rows.
        conn.execute(f"CREATE TABLE IF NOT EXISTS {EFFECTS} (effect_key text NOT NULL)")
        conn.execute(f"TRUNCATE {KEYS}, {EFFECTS}")

    keys, distinct = stream(args.messages, args.duplicates)
    ready = multiprocessing.Barrier(args.workers + 1)
    workers = [
        multiprocessing.Process(
            target=consume, args=(args.database, keys[worker :: args.workers], ready)
        )
        for worker in range(args.workers)
    ]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.monotonic()
    for worker in workers:
        worker.join()
    seconds = time.monotonic() - started
    if any(worker.exitcode != 0 for worker in workers):
        raise SystemExit("a worker failed")

    with psycopg.connect(args.database) as conn:
        effects, doubled = conn.execute(
            f"SELECT count(*), count(*) - count(DISTINCT effect_key) FROM {EFFECTS}"
        ).fetchone()
    print(
        json.dumps(
            {
                "peer": "python-psycopg",
                "messages": args.messages,
                "workers": args.workers,
                "seconds": round(seconds, 3),
                "messages_per_second": round(args.messages / seconds),
                "effects": effects,
                "distinct_keys": distinct,
            }
        )
    )
    if effects != distinct or doubled != 0:
        raise SystemExit(f"{effects} effect rows ({doubled} doubled) for {distinct} distinct keys")


if __name__ == "__main__":
    main()
