"""The plain path's flat buffers (klppo/parallel/plain.py): each kind of trained parameter (device, compute
dtype, master dtype) laid end to end in one buffer per copy, so that the per-step copy and the
gradient accumulation are a few kernels, with the arithmetic of the per-tensor ops bit for bit
(``PerTensor``: the same class with every parameter in its own storage, the per-tensor ops alone)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from klppo.parallel import plain
from klppo.parallel.plain import MasterWeights

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class PerTensor(MasterWeights):
    """The oracle: no flat buffer, every parameter loose (the path of a non-contiguous parameter)."""

    def _build_flats(self, trained, param_dtype):
        return [], trained


class Net(nn.Module):
    """A tied embedding and head, trained layers, a frozen one and a non-contiguous parameter."""

    def __init__(self, dtype: torch.dtype = FP32, num_layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(num_layers))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.t = nn.Parameter(torch.randn(8, 8).t())  # not contiguous: keeps its own storage
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.to(dtype)

    def forward(self, ids: torch.Tensor, *, skip: int | None = None) -> torch.Tensor:
        h = self.emb(ids)
        for i, layer in enumerate(self.layers):
            h = h if i == skip else layer(h)
        return self.head(self.frozen(h) @ self.t)


def _pair(compute, master, reduce, **kw) -> tuple[MasterWeights, MasterWeights]:
    return tuple(
        cls(Net(master, **kw), param_dtype=compute, reduce_dtype=reduce) for cls in (MasterWeights, PerTensor)
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_grads(a: MasterWeights, b: MasterWeights) -> None:
    for ma, mb in zip(a.masters, b.masters, strict=True):
        assert (ma.grad is None) == (mb.grad is None)
        if ma.grad is not None:
            assert ma.grad.dtype == mb.grad.dtype and torch.equal(_bits(ma.grad), _bits(mb.grad))
    assert all(p.grad is None for p in a.params)


def _flat_grads_taken(ms: MasterWeights) -> bool:
    """Whether every trained flat buffer's masters hold views of one flat gradient."""
    return bool(ms._flats) and all(f.master_grad() is not None for f in ms._flats)


def test_parameters_and_masters_are_views_of_one_buffer_per_kind():
    model = Net()
    ms = MasterWeights(model, param_dtype=BF16, reduce_dtype=FP32)
    assert [(f.compute.dtype, f.master.dtype) for f in ms._flats] == [(BF16, FP32)]
    assert all(p.requires_grad for f in ms._flats for p in f.params)
    assert model.head.weight is model.emb.weight  # the tie kept, its parameter laid out once
    assert [p for p, _ in ms._loose] == [model.t] and model.t.stride() == (1, 8) and model.t.dtype == BF16
    laid_out = [p for f in ms._flats for p in f.params]
    assert len(laid_out) == len(ms.params) - 3 == len({id(p) for p in laid_out})  # not t, frozen's two
    for f in ms._flats:
        for params, flat in ((f.params, f.compute), (f.masters, f.master)):
            ptr = flat.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == ptr for p in params)
            offsets = [p.storage_offset() for p in params]
            assert offsets == [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        assert torch.equal(f.compute, f.master.to(BF16))
    # writes through the buffers reach the model and the optimizer's parameters; a load keeps the layout
    ms._flats[0].master.fill_(0.5)
    ms.copy_to_model()
    assert all(torch.all(p == 0.5) for p in ms._flats[0].params)
    state = {k: torch.full_like(v, 0.25) for k, v in ms.module.state_dict().items()}
    ms.module.load_state_dict(state)
    assert all(torch.all(p == 0.25) for p in ms.params)
    assert all(
        m.untyped_storage().data_ptr() == f.master.untyped_storage().data_ptr()
        for f in ms._flats
        for m in f.masters
    )


def _master_bytes(ms: MasterWeights) -> int:
    """Bytes of master storage beside the compute copy (each storage once)."""
    own = {id(p) for p in ms.params}
    storages = {m.untyped_storage().data_ptr(): m.untyped_storage() for m in ms.masters if id(m) not in own}
    return sum(s.nbytes() for s in storages.values())


@pytest.mark.parametrize("host_masters", [False, True])
def test_a_frozen_parameter_is_its_own_master_and_holds_no_master_storage(host_masters):
    """Masters (fp32) of the trained parameters only; a frozen one is the compute parameter itself, cast once
    to the compute dtype, with no gradient holder; a load reaches it in place, cast to the compute dtype."""
    model = Net()
    original = model.frozen.weight.detach().clone()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen == 72
    ms = MasterWeights(model, param_dtype=BF16, reduce_dtype=FP32, host_masters=host_masters)
    assert _master_bytes(ms) == trained * 4  # not (trained + frozen) * 4
    for p, m in zip(ms.params, ms.masters, strict=True):
        assert (m is p) == (not p.requires_grad) and p.dtype == BF16
    assert torch.equal(model.frozen.weight, original.to(BF16))
    assert len(ms.grad_params) == len(ms.params) - (2 if host_masters else 0)  # holders: trained only
    module = dict(ms.module.named_parameters())
    assert module["frozen.weight"] is model.frozen.weight and module["frozen.bias"] is model.frozen.bias
    assert {id(p) for p in ms.parameters()} == {id(p) for p in ms.params} | {id(m) for m in ms.masters}
    state = ms.module.state_dict()
    assert state["frozen.weight"].dtype == BF16 and state["emb.weight"].dtype == FP32
    loaded = {k: v.float() + 2.0**-12 for k, v in state.items()}  # off the bf16 grid: rounded on load
    ms.module.load_state_dict(loaded)
    assert torch.equal(model.frozen.weight, loaded["frozen.weight"].to(BF16))
    assert torch.equal(model.emb.weight, loaded["emb.weight"].to(BF16))


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_copy_to_model_rounds_as_the_per_tensor_copies_bit_for_bit(dtype):
    flat, each = _pair(dtype, FP32, FP32)
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(flat.masters, each.masters):  # every fp32 bit pattern: ties, subnormals, overflow, nan
        bits = torch.randint(-(2**31), 2**31 - 1, a.shape, generator=gen, dtype=torch.int32)
        bits[..., ::3] &= ~0xFFFF if dtype == BF16 else ~0x1FFF
        bits[..., ::3] |= 0x8000 if dtype == BF16 else 0x1000  # exactly halfway between two neighbours
        a.data.copy_(bits.view(FP32))
        b.data.copy_(bits.view(FP32))
    assert len(flat._flats) == 1 and not each._flats
    for loaded in (False, True):
        flat.copy_to_model(loaded=loaded)
        each.copy_to_model(loaded=loaded)
        for p, q in zip(flat.params, each.params):
            assert torch.equal(_bits(p), _bits(q))
    assert all(torch.equal(_bits(p), _bits(m.to(dtype))) for p, m in zip(flat.params, flat.masters))


@pytest.mark.parametrize(
    ("compute", "master", "reduce"),
    [(BF16, FP32, FP32), (BF16, FP32, BF16), (FP16, BF16, FP16), (FP32, BF16, FP32), (FP32, FP32, BF16)],
)
@pytest.mark.parametrize("chunk_bytes", [plain.CHUNK_BYTES, 160])
def test_accumulate_adds_as_the_per_tensor_path_bit_for_bit(
    compute, master, reduce, chunk_bytes, monkeypatch
):
    """In one chunk, and in chunks of 160 bytes: in bf16 the embedding alone, each layer's weight and bias
    together; in fp32 every parameter alone."""
    monkeypatch.setattr(plain, "CHUNK_BYTES", chunk_bytes)
    flat, each = _pair(compute, master, reduce)
    assert len(flat._flats[0].chunks) == (1 if chunk_bytes > 160 else 3 if compute != FP32 else 5)
    gen = torch.Generator().manual_seed(2)
    for _step in range(2):
        for micro in range(3):  # values on ties of the narrower dtypes (test_plain's) and random ones
            for p, q in zip(flat.params, each.params):
                if not p.requires_grad:
                    continue
                g = torch.randn(p.shape, generator=gen) * 2.0**-8 if micro else torch.ones(p.shape)
                g[..., ::2] = 2.0**-8 * (1 + 2.0**-10)
                p.grad, q.grad = g.to(compute), g.to(compute)
            flat.accumulate_grads()
            each.accumulate_grads()
            _same_grads(flat, each)
            assert _flat_grads_taken(flat)
        for ms in (flat, each):  # the optimizer's zero_grad: the next step assigns again
            for m in ms.masters:
                m.grad = None


@pytest.mark.parametrize("chunk_bytes", [plain.CHUNK_BYTES, 160])
def test_a_parameter_a_backward_does_not_reach_keeps_no_gradient(chunk_bytes, monkeypatch):
    """A backward that skips a layer leaves its parameters no gradient: a master without one keeps none, one
    with a gradient keeps it; the buffer falls back to the per-tensor ops until the next step starts."""
    monkeypatch.setattr(plain, "CHUNK_BYTES", chunk_bytes)
    flat, each = _pair(BF16, FP32, FP32)
    ids = torch.arange(12).reshape(3, 4)
    skips = [0, None, 1, None]  # a layer skipped, none, another one, none
    for step in range(2):
        for skip in skips[step:]:
            for ms in (flat, each):
                ms.model(ids, skip=skip).float().square().mean().backward()
                ms.accumulate_grads()
            _same_grads(flat, each)
            if skip is not None:
                assert flat.model.layers[skip].weight.grad is None
        assert _flat_grads_taken(flat) == (step == 1)  # step 0 began with a skip; step 1 with all reached
        skipped_in_step = {s for s in skips[step:] if s is not None}
        for i, layer in enumerate(flat.model.layers):  # reached once in the step: a master gradient
            master = flat.masters[[id(p) for p in flat.params].index(id(layer.weight))]
            assert master.grad is not None or i in skipped_in_step
        for ms in (flat, each):
            for m in ms.masters:
                m.grad = None


def _kernel_ops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds = {"aten::copy_", "aten::add_", "aten::cat", "aten::fill_"}
    return sum(collections.Counter(e.name for e in prof.events() if e.name in kinds).values())


def test_the_per_step_elementwise_work_is_a_few_kernels_whatever_the_number_of_parameters():
    """32 layers (70 parameters): the copy one kernel, an accumulation three (concatenation, cast, add) and
    the per-tensor loose parameter's; per tensor, one per parameter and more."""
    counts = {}
    for ms in _pair(BF16, FP32, FP32, num_layers=32):
        ids = torch.arange(12).reshape(3, 4)
        ops = []
        for _ in range(2):
            ms.model(ids).float().square().mean().backward()
            ops.append(_kernel_ops(ms.accumulate_grads))
        ops.append(_kernel_ops(ms.copy_to_model))
        counts[not isinstance(ms, PerTensor)] = ops
    assert counts[True] == [1 + 1 + 1, 1 + 2 + 2, 1 + 1]  # flat, then the loose parameter's
    assert all(n >= 66 for n in counts[False])


def test_the_models_own_to_leaves_views_already_on_the_device_in_place():
    """``to`` moves each buffer whole and points the views into it; the model's ``to`` that follows (its
    buffers, the loose parameters) then finds the laid-out parameters on the device and must leave them:
    here every tensor is already there, as the laid-out ones are then (the move itself: the GPU test
    below)."""
    ms = MasterWeights(Net(), param_dtype=BF16, reduce_dtype=FP32)
    ms.model(torch.arange(12).reshape(3, 4)).float().square().mean().backward()
    ms.accumulate_grads()
    grad = ms._flats[0].master_grad()
    ms.to(torch.device("cpu"))
    for f in ms._flats:
        for params, buffer in ((f.params, f.compute), (f.masters, f.master)):
            ptr = buffer.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == ptr for p in params)
    assert ms._flats[0].master_grad() is grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_offload_round_trip_keeps_the_layout_and_the_gradients():
    flat, each = _pair(BF16, FP32, FP32)
    ids = torch.arange(12).reshape(3, 4)
    for ms in (flat, each):
        ms.to(torch.device("cuda"))
        ms.model(ids.cuda()).float().square().mean().backward()
        ms.accumulate_grads()
        ms.to(torch.device("cpu"))
        ms.to(torch.device("cuda"))
        ms.model(ids.cuda()).float().square().mean().backward()
        ms.accumulate_grads()
    _same_grads(flat, each)
    assert _flat_grads_taken(flat)
    for f in flat._flats:
        assert f.compute.is_cuda and f.master.is_cuda
        for params, buffer in ((f.params, f.compute), (f.masters, f.master)):
            ptr = buffer.untyped_storage().data_ptr()
            assert all(p.is_cuda and p.untyped_storage().data_ptr() == ptr for p in params)
    for m in flat.masters:
        m.data.add_(1.0)
    flat.copy_to_model(loaded=True)
    assert all(torch.equal(p, m.to(BF16)) for p, m in zip(flat.params, flat.masters) if p is not m)
