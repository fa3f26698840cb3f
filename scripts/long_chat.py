#!/usr/bin/env python3
"""A long chat through one session: does the time to first token stay flat when the conversation
outgrows the context (system prompt kept, oldest turns dropped, KV cache shifted)?

    python scripts/long_chat.py --turns 1000 --max-context 512      # default artifact, 2 threads

Prints, per block of turns, the median and max TTFT, the tokens prefilled per turn, and how many
turns dropped old messages and shifted the cache instead of computing it again.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is your name?", "Tell me about the moon.", "Why do cats purr?", "What is two plus two?",
             "Name a big animal.", "What color is grass?", "Sing me a short song.", "Where do fish live?"]


def main() -> int:
    import runtime

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", help="artifact directory (default: the default artifact, which must exist)")
    ap.add_argument("--turns", type=int, default=1000, help="user turns (default: %(default)s)")
    ap.add_argument("--max-context", type=int, default=512, help="session context in tokens (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="reply length cap (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default: %(default)s)")
    ap.add_argument("--block", type=int, default=100, help="turns per printed row (default: %(default)s)")
    args = ap.parse_args()
    model = runtime.load(args.artifact or runtime.default_artifact(), threads=args.threads)
    session = model.new_session(max_context=args.max_context)
    system = {"role": "system", "content": "You are Pip, a friendly robot toy. Answer in one short sentence."}
    history = [system]
    cfg = runtime.GenerationConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    print(f"{'turns':>11} {'TTFT median':>12} {'TTFT max':>9} {'prefilled/turn':>15} {'drops':>6} {'shifts':>7}")
    for turn in range(args.turns):
        history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        reply = "".join(session.chat(history, cfg))
        st = session.last_stats
        if st.dropped_messages:
            history = [system] + history[1 + st.dropped_messages :]
        history.append({"role": "assistant", "content": reply})
        rows.append((st.ttft_s * 1e3, st.prompt_tokens - st.reused_tokens, st.dropped_messages > 0,
                     st.shifted_tokens > 0))
        if len(rows) == args.block or turn == args.turns - 1:
            t = [r[0] for r in rows]
            print(f"{turn + 2 - len(rows):>5}-{turn + 1:<5} {statistics.median(t):>9.1f} ms {max(t):>6.1f} ms "
                  f"{statistics.median(r[1] for r in rows):>15.0f} {sum(r[2] for r in rows):>6} "
                  f"{sum(r[3] for r in rows):>7}")
            rows = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
