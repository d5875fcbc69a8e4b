"""Issue 18 prototype: the actor's update micro-batch as one CUDA graph, against the same work op by op.

The TRL workload's updates are host-bound (bench/RESULTS.md, session 19: the GPU busy 18–32% of them, 47,000
CPU operators per update for ≈ 10,000 kernels). This measures the ceiling of the change that would remove
that host work: on a plain model (no FSDP: bf16 parameters, fp32 master weights in a fused AdamW, as the
one-GPU path), a packed micro-batch of fixed shape — the forward with klppo's packed attention and compiled
layers, the token log-probs and entropy from the LM head (fused or not), the PPO clipped loss with a k3 KL
term and the backward — is

- ``eager``: launched op by op, as the trainer does (the compiled layers' kernels, the rest eager);
- ``graphed``: captured once as a CUDA graph (``torch.cuda.graph``) and replayed for every micro-batch, its
  inputs copied into the graph's static tensors first.

After each micro-batch the bf16 gradients go into fp32 master gradients (one foreach copy), then the clip
and the fused AdamW step on the masters and one foreach copy back into the bf16 parameters — outside the
graph, the same in both variants. Both variants start from the same weights and data: their losses and
final weights are compared (equal up to the kernels' run-to-run order: the graph replays the kernels the
eager pass launched).

    python3 bench/graphed_update.py --out $OUT/graphed.json            # Qwen2.5-0.5B shape, 16 × 512 tokens
    python3 bench/graphed_update.py --device cpu --tiny --rows 2 --prompt 8 --response 8 --steps 2 --variants eager   # smoke test (no graph on CPU)

Reports per variant: seconds per update of ``--mini-batches`` micro-batches (median of ``--steps`` after one
warm-up), tokens/s, ``perf/mfu/actor`` as the trainer computes it, peak memory; for ``graphed`` the capture
time; and the largest weight difference between the variants after the last step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build_model(shape: str, tiny: bool, device: torch.device, dtype: torch.dtype, compile_layers: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from klppo.batching.attention import enable_packed_attention
    from klppo.models.compiled_layers import compile_packed_layers
    from klppo.models.lm_head import fp32_lm_head
    from klppo.tune.shapes import config_kwargs

    kwargs = config_kwargs(shape)
    if tiny:
        kwargs.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384)  # fmt: skip
    config = AutoConfig.for_model("qwen2", **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    enable_packed_attention(model)
    fp32_lm_head(model)  # as the trainer's loading: fp32 logits, and the fused head's hook
    if compile_layers:
        compile_packed_layers(model)
    model.train()
    return model


def make_micro_batches(n: int, rows: int, prompt: int, response: int, vocab: int, device: torch.device):
    """``n`` micro-batches of ``rows`` full-length rows (no padding: every micro-batch has the same shape)."""
    import numpy as np

    from klppo.batching.packing import prepare_log_probs

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (rows, prompt + response), generator=g).to(device)
        mask = torch.ones_like(ids)
        pos = torch.arange(prompt + response, device=device).expand(rows, -1).contiguous()
        host = np.ones((rows, prompt + response), dtype=bool)
        inputs = prepare_log_probs(ids, mask, pos, response_length=response, use_remove_padding=True,
                                   host_mask=host)  # fmt: skip
        adv = torch.randn(rows, response, generator=g).to(device)
        out.append({"inputs": inputs, "adv": adv, "mask": torch.ones(rows, response, device=device)})
    return out


def loss_of(model, mb: dict, fused: bool) -> torch.Tensor:
    """The actor's micro-batch loss: clipped surrogate + 0.1 × k3 KL to ``ref`` − 0 × entropy (computed)."""
    from klppo.algorithms.losses import kl_loss, policy_loss
    from klppo.batching.packing import log_probs_of

    log_prob, entropy = log_probs_of(model, mb["inputs"], calculate_entropy=True, fused=fused)
    pg, _ = policy_loss(mb["old"], log_prob, mb["adv"], mb["mask"])
    kl = kl_loss(log_prob, mb["ref"], mb["mask"], kind="low_var_kl")
    ent = (entropy * mb["mask"]).sum() / mb["mask"].sum()
    return pg + 0.1 * kl - 0.0 * ent


def tensors_of(mb: dict) -> list[torch.Tensor]:
    """Every tensor a micro-batch's loss reads, in a fixed order (the graph's static inputs)."""
    x = mb["inputs"]
    found = [v for v in x.model_kwargs.values() if isinstance(v, torch.Tensor)]
    found += [t for t in (x.target, x.labels, x.head_labels, x.target_index) if t is not None]
    return found + [mb[k] for k in ("adv", "mask", "old", "ref")]


class Update:
    """bf16 parameters, fp32 masters, fused (on CUDA) AdamW on the masters; one update per mini-batch."""

    def __init__(self, model, init: list[torch.Tensor], device: torch.device) -> None:
        self.model, self.params = model, [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            torch._foreach_copy_(self.params, init)
        self.masters = [t.detach().float().clone() for t in init]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.optim = torch.optim.AdamW(self.masters, lr=1e-5, fused=device.type == "cuda")

    def step(self, grads: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_([m.grad for m in self.masters], grads)
            torch.nn.utils.clip_grad_norm_(self.masters, 1.0, foreach=True)
            self.optim.step()
            torch._foreach_copy_(self.params, self.masters)


def run_eager(model, init, batches, args, device) -> dict:
    upd = Update(model, init, device)
    times, losses = [], []
    for step in range(1 + args.steps):
        t0 = now(device)
        for mb in batches:
            loss = loss_of(model, mb, args.fused)
            loss.backward()
            upd.step([p.grad for p in upd.params])
            for p in upd.params:
                p.grad = None
            if step == args.steps:
                losses.append(loss.detach())
        times.append(now(device) - t0)
    return {"times": times, "losses": [float(x) for x in losses], "weights": upd.masters}


def run_graphed(model, init, batches, args, device) -> dict:
    upd = Update(model, init, device)
    static = {**batches[0]}  # the graph's inputs: a copy of the first micro-batch's tensors
    import copy

    static["inputs"] = copy.copy(batches[0]["inputs"])
    static["inputs"].model_kwargs = dict(batches[0]["inputs"].model_kwargs)
    src = tensors_of(batches[0])
    clones = {id(t): t.clone() for t in src}
    x = static["inputs"]
    x.model_kwargs = {k: clones.get(id(v), v) for k, v in x.model_kwargs.items()}
    for name in ("target", "labels", "head_labels", "target_index"):
        t = getattr(x, name)
        if t is not None:
            setattr(x, name, clones[id(t)])
    for k in ("adv", "mask", "old", "ref"):
        static[k] = clones[id(batches[0][k])]
    static_in = tensors_of(static)

    t0 = time.perf_counter()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream (compilation, cuBLAS workspaces)
        for _ in range(3):
            loss_of(model, static, args.fused).backward()
            for p in upd.params:
                p.grad = None
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = loss_of(model, static, args.fused)
        static_loss.backward()  # grads were None: the graph writes each replay's gradients afresh
    grads = [p.grad for p in upd.params]
    torch.cuda.synchronize(device)
    capture_s = time.perf_counter() - t0

    times, losses = [], []
    for step in range(1 + args.steps):
        t0 = now(device)
        for mb in batches:
            torch._foreach_copy_(static_in, tensors_of(mb))
            graph.replay()
            upd.step(grads)
            if step == args.steps:
                losses.append(static_loss.detach().clone())
        times.append(now(device) - t0)
    return {
        "times": times,
        "losses": [float(x) for x in losses],
        "weights": upd.masters,
        "capture_s": capture_s,
    }


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen2.5-0.5B")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-fused", dest="fused", action="store_false", help="the unfused LM head")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager decoder layers")
    parser.add_argument("--variants", nargs="+", default=["eager", "graphed"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from klppo.batching.packing import log_probs_of
    from klppo.models.flops import device_peak_flops, model_flops_per_token

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, args.tiny, device, dtype, args.compile)
    init = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    batches = make_micro_batches(args.mini_batches, args.rows, args.prompt, args.response,
                                 model.config.vocab_size, device)  # fmt: skip
    with torch.no_grad():  # π_old = π at the start (ratio 1 on the first step), a perturbed reference
        for mb in batches:
            mb["old"] = log_probs_of(model, mb["inputs"], fused=args.fused)[0].detach()
            mb["ref"] = mb["old"] + 0.01 * torch.randn_like(mb["old"])
    tokens = args.mini_batches * args.rows * (args.prompt + args.response)
    flops = model_flops_per_token(model.config, seq_len=args.prompt + args.response) * tokens
    peak = device_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    runs = {"eager": run_eager, "graphed": run_graphed}
    results: dict[str, dict] = {}
    weights = {}
    for name in args.variants:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        r = runs[name](model, init, batches, args, device)
        weights[name] = r.pop("weights")
        best = statistics.median(r["times"][1:])
        r.update(update_s=best, first_s=r["times"][0], tokens_per_s=tokens / best)
        if peak:
            r["perf/mfu/actor"] = flops / (best * peak)
        if device.type == "cuda":
            r["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        results[name] = r
        print(f"== {name}: " + json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
    if len(weights) == 2:
        a, b = weights.values()
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
        scale = max(float(x.abs().max()) for x in a)
        results["max_weight_diff"] = {"abs": diff, "largest_weight": scale}
        print(f"max |weight difference| after the last step: {diff:.3g} (largest weight {scale:.3g})")
    if "eager" in results and "graphed" in results:
        print(
            f"graphed / eager update time: {results['graphed']['update_s'] / results['eager']['update_s']:.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
