"""The DP engine's per-sample core on users' own models: the registered rules (nn.Linear anywhere, on
flat or sequence inputs; nn.Conv1d/2d with any padding, groups and padding mode; GroupNorm, LayerNorm,
Embedding; each rule alone in tests/dp/test_layer_rules.py) and the torch.func rule for every other
layer (a user's own layer) against torch.func per-sample gradients of the whole model; layers that mix
samples are a one-line error naming them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpltm.dp.engine import clipped_gradient_sum_of
from dpltm.dp.ghost import MaskLayout, clipped_gradient_sum
from dpltm.errors import DpltmUserError
from dpltm.masks import apply_masks_
from dpltm.networks.lenet import LeNet, build_architecture
from dpltm.pruning import paper_prune_rates, prune_layerwise
from tests.dp.reference import masked_reference


class Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2, bias=False),
                         nn.Tanh(), nn.Flatten(), nn.Linear(6 * 3 * 3, 5))


class Nested(nn.Module):
    """Linear layers inside submodules, one on a (B, T, in) sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleDict({"token": nn.Linear(3, 8), "mix": nn.Linear(8, 8)})
        self.pool = Pool()
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.encoder["token"](x))
        h = self.encoder["mix"](h)
        return self.head(self.pool(h))


def inplace_cnn() -> nn.Module:
    """In-place activations right after the layers (VGG style) must not change what is recorded."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=(1, 2), dilation=(1, 2)), nn.ReLU(inplace=True), nn.Flatten(),
                         nn.Linear(4 * 7 * 7, 8), nn.ReLU(inplace=True), nn.Linear(8, 5))


class Scale(nn.Module):
    """A user's own per-sample layer: a learned per-feature scale and shift."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.shift


class BatchCentring(nn.Module):
    """Mixes the samples of a batch (subtracts the batch mean): per-sample clipping bounds nothing."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=0, keepdim=True)) * self.gain


class Tokens(nn.Module):
    """Embedding → LayerNorm → Conv1d over the sequence → mean → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 4, 3, padding="same")
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x)).transpose(1, 2)
        return self.head(torch.tanh(self.conv(h)).mean(dim=2))


def exotic_cnn() -> nn.Module:
    """Convolutions the exact rule handles beyond groups=1 and numeric zero padding, and GroupNorm."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding="same"), nn.GroupNorm(2, 4), nn.ReLU(),
                         nn.Conv2d(4, 6, 3, groups=2, padding=1, padding_mode="reflect"), nn.Tanh(),
                         nn.Conv2d(6, 6, (2, 3), stride=2, padding="valid", padding_mode="circular"), nn.Flatten(),
                         nn.Linear(6 * 3 * 3, 8), Scale(8), nn.ReLU(), nn.Linear(8, 5))


def wide_cnn() -> nn.Module:
    """A layer whose formed gradients cost less than its Grams (few channels, many positions), then one whose Grams
    cost less (many channels, 2×2 positions, two groups): the unmasked rule takes each way once."""
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 24, 3, stride=2, groups=2),
                         nn.Flatten(), nn.Linear(24 * 2 * 2, 5))


def conv1d_net() -> nn.Module:
    """1-D convolutions with dilation, reflect padding, stride, groups and 'valid' padding."""
    return nn.Sequential(nn.Conv1d(3, 8, 3, padding=2, dilation=2, padding_mode="reflect"), nn.Tanh(),
                         nn.Conv1d(8, 8, 3, stride=2, groups=4, padding="valid"), nn.Flatten(), nn.Linear(8 * 5, 5))


class SequenceLinears(nn.Module):
    """A sequence Linear whose formed gradients cost less than its Grams (20 positions, 2 → 8), then one whose Grams
    cost less (4 positions, 40 → 40)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow, self.wide, self.head = nn.Linear(2, 8), nn.Linear(40, 40), nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.narrow(x)).reshape(x.shape[0], 4, 40)
        return self.head(torch.tanh(self.wide(h)).mean(dim=1))


CASES = {
    "sequence-linears": (SequenceLinears, lambda g: torch.randn(9, 20, 2, generator=g, dtype=torch.float64)),
    "conv1d": (conv1d_net, lambda g: torch.randn(9, 3, 12, generator=g, dtype=torch.float64)),
    "wide-cnn": (wide_cnn, lambda g: torch.randn(9, 3, 5, 5, generator=g, dtype=torch.float64)),
    "exotic-cnn": (exotic_cnn, lambda g: torch.randn(9, 1, 7, 8, generator=g, dtype=torch.float64)),
    "tokens": (Tokens, lambda g: torch.randint(0, 20, (9, 7), generator=g)),
    "cnn": (cnn, lambda g: torch.randn(9, 1, 7, 7, generator=g, dtype=torch.float64)),
    "inplace-cnn": (inplace_cnn, lambda g: torch.randn(9, 1, 7, 7, generator=g, dtype=torch.float64)),
    "nested": (Nested, lambda g: torch.randn(9, 4, 3, generator=g, dtype=torch.float64)),
    "sequential-mlp": (lambda: nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(),
                                             nn.Linear(7, 5)),
                       lambda g: torch.randn(9, 12, generator=g, dtype=torch.float64)),
}


def random_masks(model: nn.Module, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: torch.rand(p.shape, generator=g) < 0.6 for name, p in model.named_parameters()
            if name.endswith("weight")}


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, masks: dict[str, torch.Tensor],
              clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = masked_reference(model, masks, x, y, clip)
    return ref.norms, ref.clipped_sum


def case_batch(case: str, masked: bool, seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor,
                                                           dict[str, torch.Tensor]]:
    """A case's float64 model (seeded), a batch of 9 and, if `masked`, random masks on its weights."""
    g = torch.Generator().manual_seed(seed)
    build, data = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x, y = data(g), torch.randint(0, 5, (9,), generator=g)
    return model, x, y, random_masks(model, g) if masked else {}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True])
def test_norms_and_clipped_sums_equal_torch_func(case: str, masked: bool) -> None:
    model, x, y, masks = case_batch(case, masked, seed=0)
    with torch.no_grad():  # a ticket's pruned weights are zero
        for name, p in model.named_parameters():
            if name in masks:
                p.mul_(masks[name])
    norms, expected = reference(model, x, y, masks, clip=0.0)  # clip set below, from the norms
    clip = float(norms.median())
    norms, expected = reference(model, x, y, masks, clip)
    got = clipped_gradient_sum_of(model, x, y, clip, masks)
    torch.testing.assert_close(got.norms, norms)
    assert list(got.grad_sums) == [n for n, _ in model.named_parameters()]
    for name, value in expected.items():
        torch.testing.assert_close(got.grad_sums[name], value, msg=name)
        if name in masks:
            assert bool((got.grad_sums[name][~masks[name]] == 0).all())


def test_same_norms_and_sums_as_the_builtin_mlp_step() -> None:
    """One implementation of the math: a user's nn.Sequential with a ticket's weights and masks gets
    the norms and sums of the built-in MLP's fused step."""
    ticket = LeNet(build_architecture(12, 5, (10, 7), None), torch.Generator().manual_seed(0)).double()
    ticket_masks = ticket.full_masks()
    for _ in range(2):
        ticket_masks = apply_masks_(ticket, prune_layerwise(ticket.weights(), ticket_masks,
                                                            paper_prune_rates(ticket.mask_names())))
    plain = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5)).double()
    names = {}
    for index, (mask_name, layer) in zip((0, 2, 4), ticket.layers_in_order()):
        plain[index].load_state_dict(layer.state_dict())
        names[f"{index}.weight"] = mask_name
    masks = {name: ticket_masks[mask_name] for name, mask_name in names.items()}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(11, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (11,), generator=g)
    builtin = clipped_gradient_sum(ticket, x, y, 0.4, MaskLayout.of(ticket, ticket_masks, torch.float64))
    mine = clipped_gradient_sum_of(plain, x, y, 0.4, masks)
    torch.testing.assert_close(mine.norms, builtin.norms)
    for (index, (weight, bias)) in zip((0, 2, 4), MaskLayout.of(ticket, ticket_masks).parameter_names):
        torch.testing.assert_close(mine.grad_sums[f"{index}.weight"], builtin.grad_sums[weight])
        torch.testing.assert_close(mine.grad_sums[f"{index}.bias"], builtin.grad_sums[bias])


def mixing_model(layer: nn.Module) -> nn.Module:
    model = nn.Sequential()
    model.add_module("hidden", nn.Sequential(nn.Linear(12, 10), layer, nn.ReLU()))
    model.add_module("out", nn.Linear(10, 5))
    return model


def test_batch_norm_is_a_one_line_error_naming_it() -> None:
    layer = nn.BatchNorm1d(10)
    model = mixing_model(layer)
    x, y = torch.randn(4, 12), torch.randint(0, 5, (4,))
    with pytest.raises(DpltmUserError, match="hidden.1 \\(BatchNorm1d\\) mixes the samples"):
        clipped_gradient_sum_of(model, x, y, 1.0)
    layer.requires_grad_(False)  # batch statistics mix the samples: refused in training mode even frozen
    with pytest.raises(DpltmUserError, match="mixes the samples"):
        clipped_gradient_sum_of(model, x, y, 1.0)
    layer.eval()
    assert clipped_gradient_sum_of(model, x, y, 1.0).norms.shape == (4,)


def test_a_users_layer_that_mixes_samples_is_caught_by_the_check() -> None:
    """The torch.func rule checks that a layer of unknown type gives per-sample gradients adding up to
    the batch gradient: one that centres on the batch mean does not."""
    model = mixing_model(BatchCentring(10)).double()
    x, y = torch.randn(6, 12, dtype=torch.float64), torch.randint(0, 5, (6,))
    with pytest.raises(DpltmUserError, match="hidden.1 \\(BatchCentring\\).*depends on other samples"):
        clipped_gradient_sum_of(model, x, y, 1.0)
    model[0][1].requires_grad_(False)  # frozen it owns nothing to clip, but still mixes: not detectable here
    assert clipped_gradient_sum_of(model, x, y, 1.0).norms.shape == (6,)


class Noisy(nn.Module):
    """A user's layer with dropout inside: re-running it per sample would draw other masks."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.gain, 0.5, training=True)


def test_sparse_gradients_and_random_layers_are_refused() -> None:
    tokens, y = torch.randint(0, 10, (5, 3)), torch.randint(0, 3, (5,))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    with pytest.raises(DpltmUserError, match="layer 0 \\(Embedding\\) has sparse gradients"):
        clipped_gradient_sum_of(sparse, tokens, y, 1.0)
    noisy = nn.Sequential(nn.Linear(6, 4), Noisy(), nn.Linear(4, 3))
    with pytest.raises(DpltmUserError, match="layer 1 \\(Noisy\\): torch.func cannot form"):
        clipped_gradient_sum_of(noisy, torch.randn(5, 6), y, 1.0)


def test_running_statistics_and_tuple_outputs_are_refused() -> None:
    x, y = torch.randn(4, 2, 5, 5), torch.randint(0, 2, (4,))
    tracked = nn.Sequential(nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
                            nn.Flatten(), nn.Linear(27, 2))
    with pytest.raises(DpltmUserError, match="1 \\(InstanceNorm2d\\) keeps running statistics"):
        clipped_gradient_sum_of(tracked, x, y, 1.0)

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    with pytest.raises(DpltmUserError, match="rnn \\(GRU\\) returns a tuple"):
        clipped_gradient_sum_of(Recurrent(), torch.randn(4, 5, 3), y, 1.0)


def test_weight_sharing_is_refused() -> None:
    shared = nn.Linear(5, 5)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(torch.relu(self.layer(x)))

    with pytest.raises(DpltmUserError, match="runs twice"):
        clipped_gradient_sum_of(Twice(), torch.randn(3, 5), torch.randint(0, 5, (3,)), 1.0)
    tied = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5))
    tied[2].weight = tied[0].weight
    with pytest.raises(DpltmUserError, match="share a weight"):
        clipped_gradient_sum_of(tied, torch.randn(3, 5), torch.randint(0, 5, (3,)), 1.0)


class Folding(nn.Module):
    """Samples folded into rows before a layer: (B, T, d) reshaped to (B·T, d)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.token(x.reshape(-1, 3)).reshape(x.shape[0], -1, 5).mean(dim=1)


def test_samples_folded_into_rows_are_refused() -> None:
    """(B, T, d) reshaped to (B·T, d) before the layers would clip tokens, not samples."""

    with pytest.raises(DpltmUserError, match="one row per sample"):
        clipped_gradient_sum_of(Folding(), torch.randn(4, 6, 3), torch.randint(0, 5, (4,)), 1.0)


def test_the_wide_cnn_takes_both_ways_of_the_unmasked_convolution() -> None:
    from dpltm.dp.conv_ghost import conv_operands, ghost_pays

    model = wide_cnn()
    x = torch.randn(2, 3, 5, 5)
    first, second = model[0], model[2]
    h = model[1](first(x))
    assert not ghost_pays(*conv_operands(first, x, first(x)))
    assert ghost_pays(*conv_operands(second, h, second(h)))


class SequenceModel(nn.Module):
    """Embedding (a padding row, repeated ids) → LayerNorm → Linear on (B, T, d) → GroupNorm over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 8)
        self.group = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.norm(self.embed(ids))))  # (B, T, 8)
        return self.head(self.group(h.transpose(1, 2)).mean(dim=2))


@pytest.mark.parametrize("masked", [False, True])
def test_embedding_layernorm_and_groupnorm_rules_equal_torch_func_and_skip_the_fallback(
        masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpltm.dp import rules

    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch.func fallback ran")

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = SequenceModel().double()
    ids = torch.randint(0, 4, (9, 7), generator=g)  # few ids: repeats within a record, and the padding id 0
    y = torch.randint(0, 5, (9,), generator=g)
    masks = random_masks(model, g) if masked else {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in masks:
                p.mul_(masks[name])
    norms, _ = reference(model, ids, y, masks, clip=0.0)
    clip = float(norms.median())
    norms, expected = reference(model, ids, y, masks, clip)
    monkeypatch.setattr(rules.FuncRule, "per_sample_grads", no_fallback)
    got = clipped_gradient_sum_of(model, ids, y, clip, masks)
    torch.testing.assert_close(got.norms, norms)
    for name, value in expected.items():
        torch.testing.assert_close(got.grad_sums[name], value, msg=name)
    assert bool((got.grad_sums["embed.weight"][0] == 0).all())  # the padding row takes no gradient



EXACT_CASES = [case for case in CASES if case not in ("exotic-cnn", "nested")]  # no torch.func layer in these


@pytest.mark.parametrize("case", EXACT_CASES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("per_layer", [False, True])
def test_two_backward_passes_give_the_one_pass_bits(case: str, masked: bool, per_layer: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Above HELD_GRADIENTS_MAX_BYTES no layer's output gradient is held: norms on a first backward pass, sums on a
    second. The same rules on the same g: every norm and sum equal to the last bit, for whole and per-layer bounds."""
    import dpltm.dp.engine as engine

    model, x, y, masks = case_batch(case, masked, seed=1)
    clip = ({name: 0.3 + 0.1 * i for i, (name, m) in enumerate(model.named_modules())
             if any(p.requires_grad for p in m.parameters(recurse=False))} if per_layer else 0.5)
    passes, calls = [], []
    monkeypatch.setattr(engine, "_clip_and_sum_in_two_passes",
                        lambda *a, _f=engine._clip_and_sum_in_two_passes: calls.append(1) or _f(*a))
    for limit in (1 << 62, -1):
        monkeypatch.setattr(engine, "HELD_GRADIENTS_MAX_BYTES", limit)
        passes.append(clipped_gradient_sum_of(model, x, y, clip, masks))
    assert len(calls) == 1
    one, two = passes
    assert torch.equal(one.norms, two.norms) and torch.equal(one.loss_sum, two.loss_sum)
    assert list(one.grad_sums) == list(two.grad_sums)
    for name in one.grad_sums:
        assert torch.equal(one.grad_sums[name], two.grad_sums[name]), name


def test_two_passes_refuse_what_one_pass_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples folded into rows, and a layer the loss does not use, are the same one-line errors."""
    import dpltm.dp.engine as engine

    monkeypatch.setattr(engine, "HELD_GRADIENTS_MAX_BYTES", -1)

    with pytest.raises(DpltmUserError, match="one row per sample"):
        clipped_gradient_sum_of(Folding(), torch.randn(4, 6, 3), torch.randint(0, 5, (4,)), 1.0)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.idle = nn.Linear(3, 5), nn.Linear(3, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.idle(x)
            return self.used(x)

    with pytest.raises(DpltmUserError, match=r"does not depend on layer\(s\) \['idle'\]"):
        clipped_gradient_sum_of(Unused(), torch.randn(4, 3), torch.randint(0, 5, (4,)), 1.0)
