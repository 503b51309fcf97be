#!/usr/bin/env python
"""End-to-end check of the Ray Serve scale-out on this machine (loopback only, bounded).

Starts a local Ray (``--num-cpus``), deploys :func:`specrt.runtime.serve.ray_serve.specrt_deployment`
with ``--replicas`` replicas on 127.0.0.1, then checks through Ray's HTTP proxy that
non-streamed and streamed completions (greedy and seeded sampling) equal the local
``Engine.generate``, that ``--concurrent`` parallel clients all get correct answers, that a
bad request is a 400 JSON error, and that every replica is RUNNING. Prints one JSON summary
(exit 1 if any check fails) and shuts Ray down.

    .venv-ray/bin/python scripts/ray_serve_check.py --engines engines/default --replicas 2
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import socket
import sys
import time

from specrt.bench.common import emit


def post(port, body, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if body.get("stream") and r.status == 200:
            text, done = [], False
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("choices"):
                        text.append(ev["choices"][0]["text"])
            return r.status, {"text": "".join(text), "done": done}
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def main(argv=None) -> int:
    """Run the checks; returns the process exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="workers per replica")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs the local Ray may use")
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    from specrt import Engine, GenerationConfig
    from specrt.runtime.serve.ray_serve import specrt_deployment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    summary: dict = {"engines": args.engines, "replicas": args.replicas, "ray": ray.__version__, "checks": {}}
    checks = summary["checks"]
    t0 = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = specrt_deployment(
            args.engines, num_replicas=args.replicas, workers=args.workers, threads=args.threads, num_cpus=args.num_cpus / args.replicas, model_name="specrt"
        )
        serve.run(app, name="specrt", route_prefix="/")
        summary["deploy_s"] = round(time.perf_counter() - t0, 2)
        st = serve.status().applications["specrt"]
        reps = st.deployments["specrt"].replica_states
        summary["replica_states"] = {str(k): v for k, v in reps.items()}
        checks["all_replicas_running"] = reps.get("RUNNING", 0) == args.replicas

        engine = Engine(args.engines)
        n = args.max_tokens
        for label, settings in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, top_p=0.95, seed=3))):
            prompt = "def fib(n):"
            ref = engine.generate(prompt, GenerationConfig(max_new_tokens=n, **settings))
            status, out = post(port, dict(prompt=prompt, max_tokens=n, **settings))
            checks[f"{label}_completion_equal"] = status == 200 and out["choices"][0]["text"] == ref.text
            checks[f"{label}_usage_equal"] = status == 200 and out["usage"]["speculative"]["accepted"] == ref.stats.accepted
            status, out = post(port, dict(prompt=prompt, max_tokens=n, stream=True, **settings))
            checks[f"{label}_stream_equal"] = status == 200 and out["done"] and out["text"] == ref.text

        prompts = [f"def f{i}(x):" for i in range(args.concurrent)]
        refs = [engine.generate(p, GenerationConfig(max_new_tokens=n, temperature=0.0)).text for p in prompts]
        t1 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.concurrent) as ex:
            got = list(ex.map(lambda p: post(port, dict(prompt=p, max_tokens=n, temperature=0)), prompts))
        summary["concurrent_wall_s"] = round(time.perf_counter() - t1, 2)
        checks["concurrent_all_correct"] = all(s == 200 and o["choices"][0]["text"] == r for (s, o), r in zip(got, refs))

        status, out = post(port, dict(prompt="x", max_tokens=0))
        checks["bad_request_400"] = status == 400 and out["error"]["param"] == "max_tokens"
    finally:
        serve.shutdown()
        ray.shutdown()
    summary["total_s"] = round(time.perf_counter() - t0, 2)
    summary["ok"] = all(checks.values())
    emit(summary, args.out)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
