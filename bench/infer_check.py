#!/usr/bin/env python3
"""Inference under a budget smaller than the weights: greedy decoding of the 1.1B Llama (bench/swap_models.py's
model, random bf16 weights, no LoRA), with and without layerswap, each side in a process of its own.

    python3 bench/infer_check.py --fractions 0.5,0.25 --out infer.json   # on a GPU
    python3 bench/infer_check.py --quick --device cpu --sides resident   # the script's own smoke test, no GPU

A round is one generation: a prompt of --prompt random tokens (the prefill), then --new tokens, each one forward pass
over the last token with the KV cache (HF's DynamicCache), the next token the argmax of the logits. Every round uses
the same prompt, so every round must produce the same tokens and logits. The first --warmup rounds are not timed
(layerswap learns the step's order there: here a step is one token's forward pass). For each side the JSON holds the
tokens and a SHA-256 of every round's logits; the layerswap side's must equal the resident side's bit for bit.

The budget is bench/swap.py's rule with the weights as the movable bytes: fraction * weights + transient + margin,
where transient is the resident run's peak allocated memory less the weights (the KV cache, activations, cuBLAS's
workspace). The bound a token can reach is max(resident token time, bytes a Belady schedule must bring in a token /
H2D bandwidth); with every layer read once a token, that is the weights beyond the capacity, (1 - fraction) * weights.
"""
import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
MIB = 1 << 20
SIDES = ("resident", "layerswap")


def parse_fractions(text):
    out = []
    for part in text.split(","):
        try:
            f = float(part)
        except ValueError:
            raise ValueError(f"--fractions {text!r}: {part!r} is not a number; give fractions of the weights in "
                             f"(0, 1], comma-separated, e.g. 0.5,0.25") from None
        if not 0 < f <= 1:
            raise ValueError(f"--fractions {text!r}: {f} is not in (0, 1]")
        out.append(f)
    return out


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if s else None


def generate(model, prompt, new_tokens, sync):
    """One greedy generation: (tokens, logits digest, prefill seconds, [seconds per new token])."""
    import torch
    from transformers import DynamicCache
    digest = hashlib.sha256()
    tokens = []
    times = []
    with torch.no_grad():
        cache = DynamicCache()
        inputs = prompt  # the first pass is the prefill, each later one a token
        sync()
        for _ in range(new_tokens + 1):
            t0 = time.perf_counter()
            logits = model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[:, -1, :]
            inputs = logits.argmax(dim=-1, keepdim=True)
            tokens.append(int(inputs.item()))  # the host waits for the token, as a generation loop does
            times.append(time.perf_counter() - t0)
            digest.update(logits.float().cpu().numpy().tobytes())
    return tokens, digest.hexdigest(), times[0], times[1:]


def worker(args):
    import torch
    sys.path.insert(0, str(HERE))
    import swap_models as sm
    from swap import layerswap_traffic, ls_snapshot, worker_h2d

    out = {"side": args.side}
    ls = sm.layerswap_side(args.side, out)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    sm.make_deterministic(args.seed)
    size = sm.QUICK_LLAMA if args.quick else sm.LLAMA_SIZES[args.llama]
    model = sm.build_llama(size, args.prompt + args.new, device, args.seed, lora=False)
    model.eval()
    model.config.use_cache = True
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out["weight_bytes"] = weights
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, size.vocab, (1, args.prompt), generator=gen).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rounds = []
    before = None
    for r in range(args.rounds):
        if r == args.warmup and ls is not None:
            before = ls_snapshot(ls, device.index or 0)
        with sm.attention_backends():
            tokens, digest, prefill, times = generate(model, prompt, args.new, sync)
        rounds.append({"tokens": tokens, "logits_sha256": digest, "prefill_s": prefill,
                       "token_s_median": median(times), "token_s_mean": sum(times) / len(times)})
        if r == 0 and cuda:
            out["cublas_config"] = sm.drop_cublas_config(device)
    out["rounds"] = rounds
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        if ls is None:  # the link's speed, for the bound (bench/swap.py's measurement: 256 MiB copies)
            link = {}
            worker_h2d({}, link)
            out["h2d_gbps"] = link["h2d_gbps"]
            out["device_name"] = link["device"]
    if ls is not None:
        after = ls_snapshot(ls, device.index or 0)
        timed_tokens = max(1, (args.rounds - args.warmup) * (args.new + 1))
        traffic = layerswap_traffic(before, after, timed_tokens)  # per token (prefills counted as tokens)
        traffic.pop("sources", None)
        out["layerswap_per_token"] = traffic
        out["layerswap_peak_reserved_bytes"] = after["reserved_bytes"]["peak"]
        # LAYERSWAP_PREFETCH=tune: the distance in force at the end (0: auto), tunings finished, steps timed,
        # tunings abandoned for another step length
        out["layerswap_prefetch"] = tuned_stats(after)
    with open(args.out_file, "w") as f:
        json.dump(out, f, indent=1)


def tuned_stats(snapshot):
    """LAYERSWAP_PREFETCH=tune's figures (swap.TUNE_LEVELS) from a layerswap.stats(device) snapshot (under its
    "residency")."""
    from swap import TUNE_LEVELS
    residency = snapshot.get("residency") or {}
    return {k: residency.get(k) for k in TUNE_LEVELS}


def tuned_text(prefetch):
    """LAYERSWAP_PREFETCH=tune's outcome for the summary line ('' when it never tuned)."""
    if not prefetch or not (prefetch.get("prefetch_tunings") or prefetch.get("prefetch_tune_steps")):
        return ""
    limit = prefetch.get("prefetch_limit") or 0
    return (f"; tuned: {limit or 'auto'}{' regions' if limit else ''} (tunings finished "
            f"{prefetch.get('prefetch_tunings')}, abandoned {prefetch.get('prefetch_tune_abandoned')}, steps timed "
            f"{prefetch.get('prefetch_tune_steps')})")


def parse_variants(text):
    """--variants "default,pf1:LAYERSWAP_PREFETCH=1" -> [("default", {}), ("pf1", {"LAYERSWAP_PREFETCH": "1"})]."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, settings = part.partition(":")
        env = {}
        for kv in (x for x in settings.split("+") if x):
            key, eq, value = kv.partition("=")
            if not eq or not key.startswith("LAYERSWAP_") or key == "LAYERSWAP_BUDGET":
                raise ValueError(f"--variants {text!r}: {kv!r} is not LAYERSWAP_NAME=VALUE (the budget is the "
                                 f"fraction's); give NAME[:LAYERSWAP_X=V[+LAYERSWAP_Y=W]], comma-separated")
            env[key] = value
        if not name or name in (n for n, _ in out):
            raise ValueError(f"--variants {text!r}: each variant needs a name of its own")
        out.append((name, env))
    return out


def run_side(args, side, budget=None, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP")}
    if budget is not None:
        env["LAYERSWAP_BUDGET"] = str(budget)
        env["LAYERSWAP_STATS"] = "1"
        env.update(extra_env or {})
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--side", side, "--out-file", path,
           "--device", args.device, "--prompt", str(args.prompt), "--new", str(args.new), "--rounds",
           str(args.rounds), "--warmup", str(args.warmup), "--seed", str(args.seed), "--llama", args.llama] + \
        (["--quick"] if args.quick else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = None
    finally:
        os.unlink(path)
    if proc.returncode != 0 or res is None:
        print(log[-6000:], file=sys.stderr)
        raise RuntimeError(f"{side} side exited with {proc.returncode} and {'no' if res is None else 'a'} result")
    res["run_s"] = took
    res["stats_lines"] = [line for line in log.splitlines() if line.startswith("layerswap:")][:40]
    return res


def summary(side, args):
    timed = side["rounds"][args.warmup:]
    return {"token_s": median([r["token_s_median"] for r in timed]), "prefill_s": median([r["prefill_s"] for r in timed])}


def same_rounds(a, b):
    """Every round's tokens and logits digest equal."""
    return len(a["rounds"]) == len(b["rounds"]) and all(
        x["tokens"] == y["tokens"] and x["logits_sha256"] == y["logits_sha256"] for x, y in zip(a["rounds"], b["rounds"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fractions", default="0.5,0.25", help="budgets as fractions of the weights (default 0.5,0.25)")
    ap.add_argument("--sides", default="resident,layerswap", help="resident alone checks the script without a GPU")
    ap.add_argument("--variants", default="default",
                    help="layerswap's runs at each fraction: NAME[:LAYERSWAP_X=V[+LAYERSWAP_Y=W]], comma-separated "
                         "(default: default, the settings' defaults)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--new", type=int, default=64, help="tokens generated a round (default 64)")
    ap.add_argument("--rounds", type=int, default=4, help="generations a side (default 4)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds not timed (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama", default="1b", help="the model's size, a key of swap_models.LLAMA_SIZES (default 1b)")
    ap.add_argument("--quick", action="store_true", help="a tiny Llama (the script's smoke test)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (resident side only)")
    ap.add_argument("--margin-mib", type=float, default=256, help="budget margin over the rule's parts (default 256)")
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad or "resident" not in sides:
        ap.error(f"--sides {args.sides!r}: give resident, optionally with layerswap (the sides: {', '.join(SIDES)})")
    if "layerswap" in sides and args.device != "cuda":
        ap.error(f"--device {args.device!r}: layerswap runs on cuda only")
    if not 0 <= args.warmup < args.rounds:
        ap.error(f"--warmup {args.warmup} and --rounds {args.rounds}: at least one round must be timed")
    if args.new < 1 or args.prompt < 1:
        ap.error("--new and --prompt must be at least 1")
    try:
        fractions = parse_fractions(args.fractions)
        variants = parse_variants(args.variants)
    except ValueError as e:
        ap.error(str(e))
    sys.path.insert(0, str(HERE))
    res = {"benchmark": "infer_check", "settings": {k: getattr(args, k) for k in
                                                    ("prompt", "new", "rounds", "warmup", "seed", "llama", "quick")},
           "cases": []}
    resident = run_side(args, "resident")
    r_sum = summary(resident, args)
    res["resident"] = {**r_sum, "weight_bytes": resident["weight_bytes"],
                       "peak_allocated_bytes": resident.get("peak_allocated_bytes"),
                       "rounds_equal": all(x["tokens"] == resident["rounds"][0]["tokens"] and
                                           x["logits_sha256"] == resident["rounds"][0]["logits_sha256"]
                                           for x in resident["rounds"])}
    print(f"resident: {r_sum['token_s'] * 1e3:.2f} ms a token, prefill {r_sum['prefill_s'] * 1e3:.1f} ms; weights "
          f"{resident['weight_bytes'] / 2**30:.2f} GiB, peak allocated "
          f"{(resident.get('peak_allocated_bytes') or 0) / 2**30:.2f} GiB; rounds equal: "
          f"{res['resident']['rounds_equal']}", flush=True)
    if "layerswap" in sides:
        from swap import swap_budget
        h2d = resident.get("h2d_gbps")
        res["h2d_gbps"] = h2d
        res["device"] = resident.get("device_name")
        weights = resident["weight_bytes"]
        transient = max(0, (resident.get("peak_allocated_bytes") or 0) - weights)
        for fraction, (variant, extra) in ((f, v) for f in fractions for v in variants):
            plan = swap_budget(fraction, weights, transient, int(args.margin_mib * MIB))
            case = {"fraction": fraction, "variant": variant, "env": extra, **plan}
            label = f"{fraction} {variant}"
            try:
                ls = run_side(args, "layerswap", plan["budget_bytes"], extra)
            except RuntimeError as e:
                case["error"] = str(e)
                res["cases"].append(case)
                print(f"{label}: {e}", flush=True)
                continue
            l_sum = summary(ls, args)
            s_bytes = (1 - fraction) * weights
            bound = max(r_sum["token_s"], s_bytes / (h2d * 1e9)) if h2d else None
            case.update({"bitwise_equal": same_rounds(resident, ls), **{f"layerswap_{k}": v for k, v in l_sum.items()},
                         "resident_token_s": r_sum["token_s"], "belady_h2d_bytes_per_token": s_bytes,
                         "bound_token_s": bound, "token_over_bound": l_sum["token_s"] / bound if bound else None,
                         "layerswap_per_token": ls.get("layerswap_per_token"),
                         "layerswap_peak_reserved_bytes": ls.get("layerswap_peak_reserved_bytes"),
                         "layerswap_prefetch": ls.get("layerswap_prefetch"),
                         "run_s": ls["run_s"], "stats_lines": ls["stats_lines"]})
            res["cases"].append(case)
            t = ls.get("layerswap_per_token") or {}
            print(f"{label}: budget {plan['budget_bytes'] / 2**30:.2f} GiB; bitwise equal {case['bitwise_equal']}; "
                  f"{l_sum['token_s'] * 1e3:.2f} ms a token ({l_sum['token_s'] / r_sum['token_s']:.2f}x resident"
                  + (f", {case['token_over_bound']:.2f}x the bound {bound * 1e3:.2f} ms" if bound else "")
                  + f"), prefill {l_sum['prefill_s'] * 1e3:.1f} ms; per token: H2D "
                  f"{(t.get('bytes_h2d_per_step') or 0) / 1e9:.2f} GB, hit rate {t.get('hit_rate') or 0:.3f}, "
                  f"launch waits {(t.get('launch_wait_s_per_step') or 0) * 1e3:.1f} ms, remaps "
                  f"{(t.get('remap_s_per_step') or 0) * 1e3:.1f} ms"
                  + tuned_text(ls.get("layerswap_prefetch")), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print("wrote", args.out)
    failed = [c["fraction"] for c in res["cases"] if c.get("error") or not c.get("bitwise_equal")]
    return 1 if failed or not res["resident"]["rounds_equal"] else 0


if __name__ == "__main__":
    sys.exit(main())
