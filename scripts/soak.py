#!/usr/bin/env python
"""Soak and overhead measurements of ``boardtalk serve`` (runtime/serve/), in one process.

    python scripts/soak.py soak  [--api-turns 500] [--voice-turns 200] [--artifact DIR]
    python scripts/soak.py bench [--runs 60]            # API TTFT over the in-process call, p50 and spread
    python scripts/soak.py rss                          # RSS that the HTTP layer (aiohttp) adds

soak: the service (API on an ephemeral loopback port, no audio devices) answers ``--api-turns`` requests
(plain, streaming, and every tenth cut mid-stream by the client) while a voice loop on the same model
(through the compute gate, as in the service) answers ``--voice-turns`` spoken questions, synthesized once
by the TTS engine and fed at real-time pace. After a warm-up (the first 10 % of each) it samples RSS, open
fds and threads; the growth from there to the end must stay under 2 MiB, 0 fds, 0 threads (exit 1 if not).
The voice part needs the voice extra; ``--voice-turns 0`` skips it. CI runs a shortened soak.

Time the benches under the shared lock: ``flock /tmp/boardtalk-bench.lock python scripts/soak.py bench``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import runtime  # noqa: E402
from runtime.serve.config import from_dict  # noqa: E402
from runtime.serve.service import Background  # noqa: E402

SYSTEM = "You are a helpful assistant."
QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "Count to five.", "Say hello.",
             "What is two plus two?", "Name a planet."]


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def snapshot() -> dict:
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # count what is held, not what malloc keeps cached
    except (OSError, AttributeError):
        pass
    return {"rss_kib": rss_kib(), "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def _artifact(args) -> Path:
    return Path(args.artifact) if args.artifact else runtime.default_artifact()


def _service(args, **api):
    cfg = from_dict({"api": {"port": 0, "max_tokens": args.max_tokens, "queue": 16, **api},
                     "audio": {"enabled": False}, "model": {"system_prompt": SYSTEM, "threads": args.threads}})
    return Background(cfg, lambda sec: runtime.load(_artifact(args), threads=sec.threads))


def http(port: int, body: dict, stream: bool = False, cut_after: int | None = None) -> tuple[float, str]:
    """(seconds to the first content byte, text) of one request on a raw socket (no client library in the
    measurement); cut_after: close the connection after that many content chunks."""
    data = json.dumps({**body, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    t0 = time.perf_counter()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
    buf, ttft, chunks, text = b"", None, 0, []
    while True:
        b = s.recv(65536)
        if not b:
            break
        buf += b
        if stream:
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                ev = ev.split(b"data: ", 1)[-1]
                if ev == b"[DONE]" or not ev.startswith(b"{"):
                    continue
                d = json.loads(ev)
                c = d["choices"][0]["delta"].get("content") if d.get("choices") else None
                if c:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(c)
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        s.close()
                        return ttft, "".join(text)
    s.close()
    if not stream:
        ttft = time.perf_counter() - t0
        body = buf.split(b"\r\n\r\n", 1)[1]
        text = [json.loads(body)["choices"][0]["message"]["content"]]
    return ttft, "".join(text)


# ---- bench: TTFT added by the HTTP layer --------------------------------------------------------------

def cmd_bench(args) -> int:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    with _service(args) as svc:
        model = svc.model
        sess = model.new_session()
        ids = model.chat_ids(msgs)
        cfg = runtime.GenerationConfig(max_new_tokens=4)
        inproc, api = [], []
        for i in range(args.runs + 5):  # alternate, so drift and neighbours hit both alike
            t0 = time.perf_counter()
            it = sess.stream(ids, cfg)
            next(it)
            a = time.perf_counter() - t0
            for _ in it:
                pass
            b, _ = http(svc.api_port, {"messages": msgs[1:], "max_tokens": 4}, stream=True)
            if i >= 5:
                inproc.append(a)
                api.append(b)
        sess.close()
    diff = sorted(b - a for a, b in zip(inproc, api))

    def q(x, p):
        return sorted(x)[int(p * (len(x) - 1))] * 1e3

    print(f"TTFT over {args.runs} runs (same prompt, prefix cached; streaming over loopback; ms)")
    print(f"{'':>12} {'p10':>7} {'p50':>7} {'p90':>7}")
    for name, x in (("in-process", inproc), ("HTTP API", api), ("added", diff)):
        print(f"{name:>12} {q(x, .1):7.2f} {q(x, .5):7.2f} {q(x, .9):7.2f}")
    return 0


# ---- rss: what aiohttp and the API add -------------------------------------------------------------------

def cmd_rss(args) -> int:
    if args.mode:
        return _rss_child(args)
    res = {}
    for mode in ("inproc", "api"):
        out = subprocess.run([sys.executable, __file__, "rss", "--mode", mode, "--threads", str(args.threads or 0)]
                             + (["--artifact", args.artifact] if args.artifact else []),
                             capture_output=True, text=True, check=True).stdout
        res[mode] = json.loads(out.strip().splitlines()[-1])
    print("RSS after load + system prompt + 20 requests (MiB)")
    for mode, r in res.items():
        print(f"  {mode:>7}: {r['rss_kib'] / 1024:6.1f}  (import aiohttp alone: +{r.get('import_kib', 0) / 1024:.1f})")
    print(f"  added by the HTTP API: {(res['api']['rss_kib'] - res['inproc']['rss_kib']) / 1024:+.1f} MiB")
    return 0


def _rss_child(args) -> int:
    args.threads = args.threads or None
    msgs = [{"role": "user", "content": q} for q in QUESTIONS]
    if args.mode == "inproc":  # the service's worker and asyncio loop, without the HTTP layer
        import asyncio

        from runtime.serve.scheduler import AsyncJob, ComputeGate, Scheduler

        model = runtime.load(_artifact(args), threads=args.threads)
        sched = Scheduler(model, ComputeGate(), queue_bound=16, system_prompt=SYSTEM)
        sched.warm()
        sched.start()

        async def run():
            for i in range(20):
                job = AsyncJob([{"role": "system", "content": SYSTEM}, msgs[i % len(msgs)]],
                               runtime.GenerationConfig(max_new_tokens=16), loop=asyncio.get_running_loop())
                sched.submit(job)
                while (await job.next())[0] != "done":
                    pass

        asyncio.run(run())
        print(json.dumps(snapshot()))
        sched.stop()
        return 0
    before = rss_kib()
    import aiohttp.web  # noqa: F401
    imported = rss_kib() - before
    with _service(args) as svc:
        for i in range(20):
            http(svc.api_port, {"messages": [msgs[i % len(msgs)]], "max_tokens": 16}, stream=bool(i % 2))
        print(json.dumps({**snapshot(), "import_kib": imported}))
    return 0


# ---- soak -----------------------------------------------------------------------------------------------

def _voice_turns(svc, n: int, stop: threading.Event, done: list, warm: threading.Event,
                 finished: threading.Event, latency: list | None = None,
                 api_running: threading.Event | None = None) -> None:
    """n spoken questions through a VoiceLoop sharing the service's model and gate, at real-time pace."""
    from runtime.serve.scheduler import GatedModel
    from runtime.voice.engines import SAMPLE_RATE, VAD_WINDOW, open_engine
    from runtime.voice.filemode import resample
    from runtime.voice.pipeline import VoiceConfig, VoiceLoop

    latency = [] if latency is None else latency
    api_running = api_running or threading.Event()
    vad, asr, tts = open_engine("vad"), open_engine("asr"), open_engine("tts")
    clips = []
    for q in QUESTIONS[:3]:
        x = np.asarray(tts.synthesize(q), np.float32)
        x = resample(x, getattr(tts, "sample_rate", 24000), SAMPLE_RATE)
        pad = np.zeros(int(0.3 * SAMPLE_RATE), np.float32)
        x = np.concatenate([pad, x, pad])
        clips.append(np.concatenate([x, np.zeros(-len(x) % VAD_WINDOW, np.float32)]))
    hold = (lambda state: svc.gate.hold_api(state == "speech")) if getattr(svc, "hold_api", True) else None
    loop = VoiceLoop(GatedModel(svc.model, svc.gate), vad, asr, tts, VoiceConfig(system=SYSTEM, max_new_tokens=16),
                     output=lambda audio, rate, t: t, clock=time.monotonic, on_state=hold)
    silence = np.zeros(VAD_WINDOW, np.float32)
    win_s = VAD_WINDOW / SAMPLE_RATE
    try:
        for k in range(n):
            if stop.is_set():
                break
            clip = clips[k % len(clips)]
            t_next = time.monotonic()
            i, tail = 0, 0
            while True:
                t_next += win_s
                time.sleep(max(0.0, t_next - time.monotonic()))
                if i < len(clip) // VAD_WINDOW:
                    loop.process(clip[i * VAD_WINDOW:(i + 1) * VAD_WINDOW], time.monotonic())
                    i += 1
                    continue
                loop.process(silence, time.monotonic())
                tail += 1
                if (loop.idle and len(loop.turns) > k) or tail > 300:
                    break
            done[0] = len(loop.turns)
            if len(loop.turns) > k:  # (first-token latency after the end of speech, API turns running?)
                latency.append((loop.turns[-1].latencies_ms()["first_token"], api_running.is_set()))
            if k + 1 == max(1, n // 10):
                warm.set()
    finally:
        warm.set()
        finished.set()
        stop.wait(60)  # the end snapshot is taken with the loop still alive, as the warm-up one was
        loop.close()


def cmd_soak(args) -> int:
    with _service(args) as svc:
        svc.hold_api = not args.no_hold  # as the service's voice loop does (runtime/serve/voice.py)
        port = svc.api_port
        warm_voice, stop, vfinished = threading.Event(), threading.Event(), threading.Event()
        vdone, latency, api_running = [0], [], threading.Event()
        api_running.set()
        vt = None
        if args.voice_turns:
            vt = threading.Thread(target=_voice_turns, args=(svc, args.voice_turns, stop, vdone, warm_voice, vfinished,
                                                             latency, api_running))
            vt.start()
        else:
            warm_voice.set()
        warm_n = max(1, args.api_turns // 10)
        base = None
        t0 = time.monotonic()
        cut = 0
        for i in range(args.api_turns):
            body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
            if i % 10 == 9:
                http(port, body, stream=True, cut_after=2)
                cut += 1
            else:
                http(port, body, stream=bool(i % 2))
            if i + 1 == warm_n:
                warm_voice.wait()
                base = snapshot()
            if (i + 1) % 50 == 0:
                print(f"  {i + 1} API turns, {vdone[0]} voice turns, {time.monotonic() - t0:.0f} s, "
                      f"{snapshot()}", file=sys.stderr, flush=True)
        api_running.clear()
        if vt is not None:
            vfinished.wait()
        time.sleep(0.5)  # the last cut request's cancellation lands
        end = snapshot()
        stop.set()
        if vt is not None:
            vt.join()
        m = svc.metrics
        cancels = m.cancellations.value("disconnect")
        steps = [j.steps_after_cancel for j in svc.scheduler.finished if j.steps_after_cancel is not None]
    growth = {k: end[k] - base[k] for k in end}
    print(f"soak: {args.api_turns} API turns ({cut} cut mid-stream, {cancels:.0f} cancellations counted), "
          f"{vdone[0]} voice turns in {time.monotonic() - t0:.0f} s")
    print(f"after warm-up: {base}; end: {end}; growth: RSS {growth['rss_kib'] / 1024:+.2f} MiB, "
          f"fds {growth['fds']:+d}, threads {growth['threads']:+d}")
    print(f"steps run after a cancel (latest): max {max(steps) if steps else '-'}")
    for busy in (True, False):
        x = sorted(ms for ms, b in latency if b == busy and ms is not None)
        if x:
            print(f"voice first token after the end of speech, API turns {'running' if busy else 'idle'}: "
                  f"p50 {x[len(x) // 2]:.0f} ms, p10-p90 {x[len(x) // 10]:.0f}-{x[(len(x) * 9) // 10]:.0f} ms "
                  f"({len(x)} turns)")
    ok = growth["rss_kib"] < 2048 and growth["fds"] <= 0 and growth["threads"] <= 0 and vdone[0] >= args.voice_turns
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["soak", "bench", "rss"])
    p.add_argument("--artifact", help="artifact directory (default: the default artifact of this board)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: the board's)")
    p.add_argument("--api-turns", type=int, default=500, help="soak: API requests (default: 500)")
    p.add_argument("--voice-turns", type=int, default=200, help="soak: voice turns (default: 200; 0 = none)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per API reply (default: 24)")
    p.add_argument("--runs", type=int, default=60, help="bench: measured runs (default: 60)")
    p.add_argument("--no-hold", action="store_true", help="soak: API steps do not wait while the user speaks "
                   "(default: they do, as in the service)")
    p.add_argument("--mode", choices=["inproc", "api"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return {"soak": cmd_soak, "bench": cmd_bench, "rss": cmd_rss}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
