"""The fast training path on the CPU: the config switch, bucket padding, compiling the transformer
layers of a real (tiny) Deformable DETR, and the --fast options of tools/train.py. The compiled
layers are traced with 'aot_eager' here (inductor's CPU code generation is minutes on CI); the
GPU tests run inductor and CUDA graphs."""

import copy
import gc
import sys
import weakref
from argparse import Namespace

import pytest
import torch

pytest.importorskip("mmdet")

from mmengine.config import Config  # noqa: E402

from synthetic_configs import DETR_R50, DINO, ROOT, TINY  # noqa: E402

from mmdeform_tma.integrations import fast_training  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))


def test_fast_config_adds_compile_hook_fused_optimizer_and_buckets():
    cfg = fast_training.fast_training_config(
        Config.fromfile(DETR_R50), compile_mode="reduce-overhead", bucket_step=64, compile_scope="network"
    )
    assert "mmdeform_tma.integrations.fast_training" in cfg.custom_imports["imports"]
    assert "mmdeform_tma" in cfg.custom_imports["imports"]
    assert [h for h in cfg.custom_hooks if h["type"] == "FastPathCompileHook"] == [
        dict(
            type="FastPathCompileHook", mode="reduce-overhead", scope="network", gc_freeze_after=20,
            batched_targets=True,
        )
    ]
    assert cfg.optim_wrapper.optimizer.type == "AdamW" and cfg.optim_wrapper.optimizer.fused is True
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsConstructor"
    assert dict(type="BatchBucketPad", step=64) in cfg.model.data_preprocessor.batch_augments
    assert cfg.model.data_preprocessor.non_blocking is True
    assert cfg.train_dataloader.pin_memory and cfg.val_dataloader.pin_memory and cfg.test_dataloader.pin_memory


def test_fast_config_leaves_a_custom_constructor_alone():
    cfg = Config.fromfile(DETR_R50)
    cfg.optim_wrapper.constructor = "LayerDecayOptimWrapperConstructor"
    fast_training.fast_training_config(cfg)
    assert cfg.optim_wrapper.constructor == "LayerDecayOptimWrapperConstructor"


def test_merged_param_groups_keep_every_parameter_s_settings_and_train_alike():
    """The tiny DETR's paramwise_cfg (backbone and sampling offsets at lr x 0.1, as mmdet's) gives a
    group per parameter; merged, a few groups remain, and a step from the same gradients moves every
    parameter as the per-parameter groups do."""
    from mmengine.optim import build_optim_wrapper

    from synthetic_batches import synthetic_batch

    settings, weights = {}, {}
    for merged in (False, True):
        model, cfg = tiny_model()
        optim_cfg = copy.deepcopy(cfg.optim_wrapper)
        if merged:
            optim_cfg.constructor = "MergedParamGroupsConstructor"
        optim = build_optim_wrapper(model, optim_cfg)
        groups = optim.optimizer.param_groups
        group_of = {id(p): group for group in groups for p in group["params"]}
        settings[merged] = {
            name: {k: v for k, v in group_of[id(p)].items() if k != "params"}
            for name, p in model.named_parameters()
            if id(p) in group_of
        }
        assert len(groups) <= 4 if merged else len(groups) == len(group_of) > 4
        model.train()
        torch.manual_seed(0)
        model.train_step(synthetic_batch(2, 128, 128, 3, torch.device("cpu"), seed=0), optim)
        weights[merged] = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert settings[True] == settings[False]
    assert {g["lr"] for g in settings[True].values()} == {2e-4, 2e-5}
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, rtol=0, atol=0, msg=name)


def test_merging_refuses_an_optimizer_with_state():
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([w])  # Adam keeps state per parameter from its first step
    w.grad = torch.ones(2)
    optimizer.step()
    with pytest.raises(ValueError, match="first step"):
        fast_training.merge_param_groups(optimizer)


def test_fast_config_is_idempotent():
    once = fast_training.fast_training_config(Config.fromfile(DETR_R50))
    twice = fast_training.fast_training_config(copy.deepcopy(once))
    assert twice.custom_hooks == once.custom_hooks
    assert twice.model.data_preprocessor.batch_augments == once.model.data_preprocessor.batch_augments
    assert twice.custom_imports == once.custom_imports


def test_fast_config_keeps_a_fixed_size_pad():
    cfg = Config.fromfile(DETR_R50)
    fixed = dict(type="BatchFixedSizePad", size=(1024, 1024))
    cfg.model.data_preprocessor.batch_augments = [fixed]
    fast_training.fast_training_config(cfg)
    assert cfg.model.data_preprocessor.batch_augments == [fixed]


def test_fast_config_refuses_an_optimizer_without_a_fused_kernel():
    cfg = Config.fromfile(DETR_R50)
    cfg.optim_wrapper.optimizer = dict(type="RMSprop", lr=1e-3)
    with pytest.raises(ValueError, match="RMSprop"):
        fast_training.fast_training_config(cfg)


def test_fast_config_refuses_an_unknown_compile_mode():
    with pytest.raises(ValueError, match="compile mode"):
        fast_training.fast_training_config(Config.fromfile(DETR_R50), compile_mode="fastest")
    with pytest.raises(ValueError, match="compile scope 'model'"):
        fast_training.fast_training_config(Config.fromfile(DETR_R50), compile_scope="model")
    with pytest.raises(ValueError, match="compile scope"):
        fast_training.FastPathCompileHook(scope="everything")


def test_bucket_pad_pads_to_the_next_multiple_and_updates_metainfo():
    from mmdet.structures import DetDataSample

    pad = fast_training.BatchBucketPad(step=128)
    samples = [DetDataSample(metainfo=dict(img_shape=(100, 150), batch_input_shape=(100, 150))) for _ in range(2)]
    inputs = torch.rand(2, 3, 100, 150) + 1
    out, samples = pad(inputs, samples)
    assert out.shape == (2, 3, 128, 256)
    torch.testing.assert_close(out[..., :100, :150], inputs)
    assert out[..., 100:, :].abs().sum() == 0 and out[..., :, 150:].abs().sum() == 0
    assert all(s.batch_input_shape == (128, 256) and s.pad_shape == (128, 256) for s in samples)
    assert all(s.metainfo[fast_training.UNBUCKETED_SHAPE] == (100, 150) for s in samples)
    assert all(s.img_shape == (100, 150) for s in samples)  # the image itself is unchanged


def test_bucket_pad_leaves_an_aligned_batch_alone():
    pad = fast_training.BatchBucketPad(step=64)
    inputs = torch.rand(1, 3, 128, 192)
    out, _ = pad(inputs, None)
    assert out is inputs


def test_bucket_pad_needs_a_positive_step():
    with pytest.raises(ValueError, match="step"):
        fast_training.BatchBucketPad(step=0)


def test_kept_extent_counts_the_level_cells_inside_the_unbucketed_batch():
    # stride 8 over 300 of 384 rows: mmdet's nearest resize maps level row i to input row 8 i
    assert fast_training.kept_extent(300, 384, 48) == 38
    assert fast_training.kept_extent(320, 384, 6) == 5  # stride 64: rows 0, 64, ..., 256
    assert fast_training.kept_extent(384, 384, 12) == 12


def dino_model():
    from benchmark_e2e import build_model

    model, _ = build_model(DINO, "pytorch", torch.device("cpu"), seed=0)
    return model.eval()  # no denoising queries: pre_decoder is then a function of its arguments


def embed_levels(memory, small, large, fill):
    """A (batch, cells, c) memory over the `small` level shapes placed top-left in the `large`
    ones; the other cells hold `fill`."""
    parts, start = [], 0
    for (h, w), (big_h, big_w) in zip(small, large):
        grid = fill[:, : big_h * big_w].reshape(memory.shape[0], big_h, big_w, -1).clone()
        grid[:, :h, :w] = memory[:, start : start + h * w].reshape(memory.shape[0], h, w, -1)
        parts.append(grid.flatten(1, 2))
        fill, start = fill[:, big_h * big_w :], start + h * w
    return torch.cat(parts, 1)


def test_two_stage_guard_selects_the_proposals_eager_selects():
    """DINO ranks every encoder cell for its top-k proposals, padding included. Given a memory over
    a bucket-padded batch, the guarded pre_decoder returns the queries and reference points that
    eager's returns over the unpadded batch; unguarded, the padding's cells take proposals."""
    from mmdet.structures import DetDataSample

    model = dino_model()
    image_shapes = [(320, 288), (240, 320)]  # batch 320 x 320, bucket 384 x 384
    eager_levels, bucket_levels = [(40, 40), (20, 20), (10, 10), (5, 5)], [(48, 48), (24, 24), (12, 12), (6, 6)]

    def pre_transformer(batch_shape, levels, unbucketed=None):
        meta = dict(batch_input_shape=batch_shape)
        if unbucketed:
            meta[fast_training.UNBUCKETED_SHAPE] = unbucketed
        samples = [DetDataSample(metainfo=dict(meta, img_shape=shape)) for shape in image_shapes]
        feats = [torch.zeros(2, 256, h, w) for h, w in levels]
        return model.pre_transformer(feats, samples)[1]

    # as at initialisation in training (session 8): every image cell scores below the padding's
    # constant (a zeroed memory's score), so the top-k takes padded cells wherever it can see them
    def score(m):
        encoder_class_branch = model.bbox_head.cls_branches[model.decoder.num_layers]
        return encoder_class_branch(model.memory_trans_norm(model.memory_trans_fc(m))).amax(-1)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pool = torch.randn(40000, 256, generator=g)
        pool = pool[score(pool) < score(torch.zeros(1, 256))]
    cells = sum(h * w for h, w in eager_levels)
    memory = pool[: 2 * cells].reshape(2, cells, 256)
    padded = embed_levels(memory, eager_levels, bucket_levels, torch.randn(2, 48 * 48 * 2, 256, generator=g))
    bucket = pre_transformer((384, 384), bucket_levels, unbucketed=(320, 320))
    unguarded, _ = model.pre_decoder(padded, bucket["memory_mask"], bucket["spatial_shapes"])

    assert fast_training.guard_two_stage_selection(model) and fast_training.guard_two_stage_selection(model)
    eager = pre_transformer((320, 320), eager_levels)
    expected, _ = model.pre_decoder(memory, eager["memory_mask"], eager["spatial_shapes"])
    bucket = pre_transformer((384, 384), bucket_levels, unbucketed=(320, 320))
    guarded, _ = model.pre_decoder(padded, bucket["memory_mask"], bucket["spatial_shapes"])

    torch.testing.assert_close(guarded["query"], expected["query"], rtol=0, atol=0)
    torch.testing.assert_close(guarded["reference_points"], expected["reference_points"], rtol=0, atol=0)
    assert guarded["memory"] is padded  # the decoder attends over the padded maps
    # a padded cell's proposal is infinite, its box (1, 1, 1, 1): eager takes those inside its batch,
    # unguarded takes more
    def padded_picks(points):
        return int((points == 1).all(-1).sum())

    assert 0 < padded_picks(expected["reference_points"]) < padded_picks(unguarded["reference_points"])
    # a batch without bucket metainfo (evaluation: no batch augments) passes through unchanged
    eager = pre_transformer((320, 320), eager_levels)
    again, _ = model.pre_decoder(memory, eager["memory_mask"], eager["spatial_shapes"])
    torch.testing.assert_close(again["reference_points"], expected["reference_points"], rtol=0, atol=0)


def test_compile_hook_guards_a_two_stage_model_and_compiles_its_decoder_whole():
    from types import SimpleNamespace

    model = dino_model()
    hook = fast_training.FastPathCompileHook(backend="aot_eager")
    hook.before_run(SimpleNamespace(model=model))
    assert model.pre_decoder._guards_two_stage_selection
    assert model.encoder.get_encoder_reference_points._uses_host_shapes
    assert hook.compiled == ["backbone", "neck", "decoder", *[f"encoder.layers.{i}" for i in range(6)]]


def test_two_stage_guard_leaves_a_one_stage_model_alone():
    model, _ = tiny_model()
    pre_decoder = model.pre_decoder
    assert not fast_training.guard_two_stage_selection(model)
    assert model.pre_decoder == pre_decoder


def scalar_reads(function, *args) -> int:
    """How many device-to-host scalar reads (.item() and friends) `function(*args)` makes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function(*args)
    return sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def test_host_shaped_encoder_reference_points_equal_mmdet_s_without_scalar_reads():
    from mmdet.models.layers.transformer import DeformableDetrTransformerEncoder
    from mmdet.structures import DetDataSample

    model = dino_model()
    mmdet_points = DeformableDetrTransformerEncoder.get_encoder_reference_points
    levels = [(40, 38), (20, 19), (10, 10), (5, 5)]
    sizes = [(320, 288), (230, 304)]
    samples = [DetDataSample(metainfo=dict(batch_input_shape=(320, 304), img_shape=s)) for s in sizes]
    feats = [torch.randn(2, 256, h, w) for h, w in levels]
    encoder_inputs, _ = model.pre_transformer(feats, samples)
    shapes, ratios = encoder_inputs["spatial_shapes"], encoder_inputs["valid_ratios"]
    assert ratios.min() < 1  # padded images: the valid ratios take part
    expected = mmdet_points(shapes, ratios, "cpu")
    assert scalar_reads(mmdet_points, shapes, ratios, "cpu") == 4 * len(levels)  # each level's H and W, twice

    assert fast_training.host_shaped_encoder_reference_points(model)
    assert fast_training.host_shaped_encoder_reference_points(model)  # once only
    encoder = model.encoder
    model.pre_transformer(feats, samples)  # records the level shapes
    assert scalar_reads(encoder.get_encoder_reference_points, shapes, ratios, "cpu") == 0
    model.pre_transformer(feats, samples)
    torch.testing.assert_close(encoder.get_encoder_reference_points(shapes, ratios, "cpu"), expected, rtol=0, atol=0)
    # taken once: the encoder run on its own, with no recorded shapes, takes mmdet's path
    assert scalar_reads(encoder.get_encoder_reference_points, shapes, ratios, "cpu") == 4 * len(levels)
    torch.testing.assert_close(encoder.get_encoder_reference_points(shapes, ratios, "cpu"), expected, rtol=0, atol=0)


def test_host_shaped_reference_points_train_as_eager_and_leave_other_models_alone(monkeypatch):
    from mmdet.models.layers.transformer import DeformableDetrTransformerEncoder

    mmdet_points, mmdet_calls = DeformableDetrTransformerEncoder.get_encoder_reference_points, []

    def counted(*args, **kwargs):
        mmdet_calls.append(1)
        return mmdet_points(*args, **kwargs)

    monkeypatch.setattr(DeformableDetrTransformerEncoder, "get_encoder_reference_points", staticmethod(counted))
    eager = tiny_training_losses(2)
    assert len(mmdet_calls) == 2
    patched = tiny_training_losses(2, patch=fast_training.host_shaped_encoder_reference_points)
    assert len(mmdet_calls) == 2  # the patched model never took mmdet's path
    assert patched == eager  # bitwise: the same float32 operations
    assert not fast_training.host_shaped_encoder_reference_points(torch.nn.Linear(2, 2))


def tiny_model(backend="pytorch"):
    from benchmark_e2e import build_model

    return build_model(TINY, backend, torch.device("cpu"), seed=0)


def test_compile_fast_path_modules_finds_every_layer():
    model, _ = tiny_model()
    names = fast_training.compile_fast_path_modules(model, scope="layers", backend="aot_eager")
    assert names == ["encoder.layers.0", "decoder.layers.0"]
    assert all(model.get_submodule(n)._compiled_call_impl is not None for n in names)
    # compiled in place: the parameter names (and so checkpoints) are unchanged
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())


def test_network_scope_compiles_the_backbone_and_neck_too():
    model, _ = tiny_model()
    names = fast_training.compile_fast_path_modules(model, scope="network", backend="aot_eager")
    assert names == ["backbone", "neck", "encoder.layers.0", "decoder.layers.0"]
    assert all(model.get_submodule(n)._compiled_call_impl is not None for n in names)


def test_network_scope_refuses_a_part_that_holds_transformer_layers():
    model, _ = tiny_model()
    model.neck = torch.nn.Sequential(model.encoder.layers[0])  # a compiled neck would swallow the layer
    with pytest.raises(ValueError, match="neck holds transformer layers"):
        fast_training.compile_fast_path_modules(model, scope="network", backend="aot_eager")


def test_compile_fast_path_modules_refuses_a_model_without_them():
    with pytest.raises(ValueError, match="no DetrTransformerEncoderLayer"):
        fast_training.compile_fast_path_modules(torch.nn.Linear(2, 2))


def tiny_training_losses(
    steps: int, dropout: bool = True, sizes=((128, 128),), graphs=None, config=TINY, patch=None, **compile_kwargs
) -> list[float]:
    """Losses of `steps` training steps of the tiny model (or `config`'s, reference backend), step i
    on images of sizes[i % len(sizes)]; compiled when given compile arguments, and then `graphs` (a
    list) gets the number of graphs compiled so far after each step; `patch(model)` first if given."""
    from benchmark_e2e import build_model, make_optim_wrapper
    from mmdet_models import switch_off_dropout
    from synthetic_batches import synthetic_batch
    from torch._dynamo.utils import counters

    model, cfg = build_model(config, "pytorch", torch.device("cpu"), seed=0)
    if not dropout:
        switch_off_dropout(model)
    if patch is not None:
        patch(model)
    if compile_kwargs:
        torch._dynamo.reset()
        counters.clear()
        fast_training.compile_fast_path_modules(model, **compile_kwargs)
    optim = make_optim_wrapper(model, cfg, "fp32")
    model.train()
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        batch = synthetic_batch(2, *sizes[step % len(sizes)], 3, torch.device("cpu"), seed=step)
        losses.append(float(model.train_step(batch, optim)["loss"]))
        if graphs is not None:
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return losses


def test_compiled_layers_train_as_eager():
    """fullgraph=True: a graph break in a layer (e.g. in the MSDA module) fails here. aot_eager
    draws dropout from the same generator in the same order as eager; inductor does not (the
    GPU test turns dropout off)."""
    eager = tiny_training_losses(2)
    compiled = tiny_training_losses(2, scope="layers", backend="aot_eager")
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled[0] != compiled[1]


def test_inductor_network_scope_trains_as_eager_with_dropout_off():
    """Inductor's own code (CPU), not aot_eager: backbone, neck and layers compiled, three training
    steps against eager. With every dropout off, nn.MultiheadAttention's included (inductor draws
    other masks), the losses agree to rounding; the same comparison caught that attention dropout
    was still on in the GPU test (8e-3 apart here, 2e-2 on an H100)."""
    eager = tiny_training_losses(3, dropout=False)
    compiled = tiny_training_losses(3, dropout=False, mode="default", scope=fast_training.DEFAULT_COMPILE_SCOPE)
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled[0] != compiled[-1]


def test_network_decoder_scope_compiles_the_decoder_whole():
    model, _ = tiny_model()
    names = fast_training.compile_fast_path_modules(model, scope="network+decoder", backend="aot_eager")
    assert names == ["backbone", "neck", "decoder", "encoder.layers.0"]
    assert model.decoder._compiled_call_impl is not None
    assert model.decoder.layers[0]._compiled_call_impl is None  # traced inside the decoder's graph


def test_network_decoder_scope_keeps_an_unknown_decoder_subclass_per_layer():
    from mmdet.models.layers.transformer import DeformableDetrTransformerDecoder

    class CustomDecoder(DeformableDetrTransformerDecoder):  # e.g. DDQ-DETR's, with host logic of its own
        pass

    model, _ = tiny_model()
    model.decoder.__class__ = CustomDecoder
    names = fast_training.compile_fast_path_modules(model, scope="network+decoder", backend="aot_eager")
    assert names == ["backbone", "neck", "encoder.layers.0", "decoder.layers.0"]


def test_dino_decoder_compiled_whole_trains_as_eager():
    """DINO's decoder takes the head's box branches as an argument and, in training, a denoising
    mask whose size follows the batch's boxes: traced whole (fullgraph) it trains as eager."""
    size = ((256, 256),)  # 1,360 encoder cells: DINO takes 900 top-k proposals
    eager = tiny_training_losses(2, dropout=False, sizes=size, config=DINO)
    compiled = tiny_training_losses(
        2, dropout=False, sizes=size, config=DINO, scope="network+decoder", backend="aot_eager"
    )
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled[0] != compiled[1]


def test_new_image_sizes_stop_compiling_once_the_graphs_turn_dynamic():
    """Multi-scale training meets dozens of bucket sizes. With the fast path's automatic dynamic
    shapes every module is compiled at most three times (static, then symbolic in height, then in
    width); later sizes reuse the graphs, including the MSDA op's planning (the reference backend
    here), and train as eager."""
    sizes = [(128, 128), (128, 256), (256, 128), (256, 256), (128, 384), (384, 256)]
    graphs = []
    eager = tiny_training_losses(len(sizes), dropout=False, sizes=sizes)
    compiled = tiny_training_losses(len(sizes), dropout=False, sizes=sizes, graphs=graphs, backend="aot_eager")
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert graphs[0] == 4  # backbone, neck, encoder layer, decoder layer
    assert graphs[3:] == [graphs[2]] * 3, f"graphs compiled after each size: {graphs}"


def test_train_tool_fast_options():
    import train

    args = train.parse_args(
        [DETR_R50, "--fast", "--compile-mode", "reduce-overhead", "--compile-scope", "network", "--bucket-step", "256"]
    )
    cfg = train.build_config(args)
    assert cfg.custom_hooks[-1] == dict(
        type="FastPathCompileHook", mode="reduce-overhead", scope="network", gc_freeze_after=20, batched_targets=True
    )
    assert cfg.model.data_preprocessor.batch_augments[-1] == dict(type="BatchBucketPad", step=256)
    plain = train.build_config(train.parse_args([DETR_R50]))
    assert "FastPathCompileHook" not in str(plain.get("custom_hooks", []))
    for flag, value in (("--compile-mode", "default"), ("--compile-scope", "layers")):
        with pytest.raises(SystemExit):
            train.build_config(train.parse_args([DETR_R50, flag, value]))


def test_train_tool_gc_freeze_option():
    import train

    def hook(argv):
        return train.build_config(train.parse_args([DETR_R50, *argv])).custom_hooks[-1]

    assert hook(["--fast"])["gc_freeze_after"] == fast_training.DEFAULT_GC_FREEZE_AFTER
    assert hook(["--fast", "--gc-freeze-after", "5"])["gc_freeze_after"] == 5
    assert hook(["--fast", "--gc-freeze-after", "0"])["gc_freeze_after"] is None  # 0: never
    for argv in (["--gc-freeze-after", "5"], ["--fast", "--gc-freeze-after", "-1"]):
        with pytest.raises(SystemExit):
            train.build_config(train.parse_args([DETR_R50, *argv]))


def test_train_tool_mmdet_targets_option():
    import train

    def hook(argv):
        return train.build_config(train.parse_args([DETR_R50, *argv])).custom_hooks[-1]

    assert hook(["--fast"])["batched_targets"] is True
    assert hook(["--fast", "--mmdet-targets"])["batched_targets"] is False
    with pytest.raises(SystemExit):
        train.build_config(train.parse_args([DETR_R50, "--mmdet-targets"]))


@pytest.fixture
def unfrozen_heap():
    """Tests that freeze the heap leave it as they found it: unfrozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    pass


def test_freezing_keeps_later_garbage_collectable(unfrozen_heap):
    frozen = fast_training.freeze_long_lived_objects()
    # Only gc.freeze adds to the permanent generation; an object of it that any thread (a loader's
    # pin-memory thread left by an earlier test) frees in between leaves it: never more, maybe fewer.
    assert 0 < gc.get_freeze_count() <= frozen
    node = _Node()
    node.self = node  # a cycle made after the freeze: only a collection frees it
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None


def test_compile_hook_freezes_the_heap_once_after_its_warm_up(unfrozen_heap, monkeypatch):
    calls = []
    real = fast_training.freeze_long_lived_objects
    monkeypatch.setattr(fast_training, "freeze_long_lived_objects", lambda: calls.append(1) or real())
    hook = fast_training.FastPathCompileHook(gc_freeze_after=3)
    runner = object()
    for _ in range(2):
        hook.after_train_iter(runner, batch_idx=0)
    assert calls == [] and hook.frozen_objects is None and gc.get_freeze_count() == 0
    hook.after_train_iter(runner, batch_idx=0)
    assert calls == [1] and 0 < gc.get_freeze_count() <= hook.frozen_objects  # see the test above
    for _ in range(5):
        hook.after_train_iter(runner, batch_idx=0)
    assert calls == [1]  # once: later objects stay collectable


def test_compile_hook_without_gc_freeze_never_freezes(unfrozen_heap):
    hook = fast_training.FastPathCompileHook(gc_freeze_after=None)
    for _ in range(30):
        hook.after_train_iter(object(), batch_idx=0)
    assert hook.frozen_objects is None and gc.get_freeze_count() == 0


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "20"])
def test_gc_freeze_after_must_be_a_positive_count_or_none(value):
    with pytest.raises(ValueError, match="gc_freeze_after"):
        fast_training.FastPathCompileHook(gc_freeze_after=value)
    with pytest.raises(ValueError, match="gc_freeze_after"):
        fast_training.fast_training_config(Config.fromfile(DETR_R50), gc_freeze_after=value)


def test_compile_hook_in_a_runner(tmp_path):
    """The hook compiles the layers of the runner's model before its first iteration; a tiny
    training run with the whole fast configuration (fused AdamW, bucket padding) completes."""
    from mmdet.utils import register_all_modules
    from mmengine.runner import Runner

    subprocess_free_dataset = tmp_path / "data"
    import make_synthetic_coco

    make_synthetic_coco.main(
        ["--out", str(subprocess_free_dataset), "--num-train", "2", "--num-val", "1", "--size", "96"]
    )
    register_all_modules()
    torch._dynamo.reset()
    cfg = fast_training.fast_training_config(Config.fromfile(TINY), bucket_step=64)
    cfg.custom_hooks[-1]["backend"] = "aot_eager"
    cfg.work_dir = str(tmp_path / "work")
    cfg.train_dataloader.dataset.data_root = f"{subprocess_free_dataset}/"
    cfg.train_cfg = dict(type="EpochBasedTrainLoop", max_epochs=1, val_interval=10)
    cfg.val_dataloader = cfg.val_evaluator = cfg.val_cfg = None
    cfg.test_dataloader = cfg.test_evaluator = cfg.test_cfg = None
    cfg.default_hooks.checkpoint = None
    runner = Runner.from_cfg(cfg)
    runner.train()
    hook = next(h for h in runner.hooks if isinstance(h, fast_training.FastPathCompileHook))
    assert hook.compiled == ["backbone", "neck", "decoder", "encoder.layers.0"]
    assert runner.optim_wrapper.optimizer.defaults["fused"] is True
    assert runner.iter == 1


def test_apply_fast_args_without_fast_is_a_no_op():
    from runner_setup import apply_fast_args

    cfg = Config.fromfile(DETR_R50)
    before = cfg.to_dict()
    no_fast = Namespace(fast=False, compile_mode=None, compile_scope=None, bucket_step=None, gc_freeze_after=None)
    apply_fast_args(cfg, no_fast)
    assert cfg.to_dict() == before


def test_mask2former_layers_compile_fullgraph_and_train():
    """Mask2Former's 6 pixel-decoder encoder layers (MSDA) and 9 masked-attention decoder layers
    compile without a graph break and train (R50, small panoptic batches, no 1024 px padding)."""
    from mmdet_models import build_model
    from mmengine.optim import build_optim_wrapper
    from synthetic_batches import batch_for_config

    cfg = Config.fromfile(str(ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_tma-ws.py"))
    cfg.model.data_preprocessor.batch_augments = None  # 64 x 96 images, not 1024 x 1024
    model = build_model(cfg, backend="pytorch")
    optim = build_optim_wrapper(model, cfg.optim_wrapper)
    torch._dynamo.reset()
    names = fast_training.compile_fast_path_modules(model, backend="aot_eager")
    assert len(names) == 16 and names[:2] == ["backbone", "panoptic_head.pixel_decoder.encoder.layers.0"]
    assert names[-1] == "panoptic_head.transformer_decoder.layers.8"
    model.train()
    losses = [
        float(model.train_step(batch_for_config(cfg, 2, 64, 96, torch.device("cpu"), seed=s), optim)["loss"])
        for s in range(2)
    ]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[1]


def test_reduce_overhead_marks_a_cuda_graph_step_before_each_model_step(monkeypatch):
    """With several compiled regions per step, each train/val/test step starts a new CUDA-graph
    iteration itself (torch's guess can take the last step's graph outputs for pending work)."""
    model, _ = tiny_model()
    calls = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append("mark"))
    model.test_step = lambda data: calls.append(("test", data)) or "out"
    fast_training.mark_cuda_graph_steps(model)
    fast_training.mark_cuda_graph_steps(model)  # idempotent: one mark per step
    assert model.test_step("batch") == "out"
    assert calls == ["mark", ("test", "batch")]
    graphed, _ = tiny_model()
    fast_training.compile_fast_path_modules(graphed, mode="reduce-overhead", backend="aot_eager")
    assert all(getattr(graphed, name)._marks_cuda_graph_steps for name in fast_training.STEP_METHODS)
    plain, _ = tiny_model()
    fast_training.compile_fast_path_modules(plain, mode="default", backend="aot_eager")
    assert not getattr(plain.train_step, "_marks_cuda_graph_steps", False)


def test_a_model_wrapper_gets_the_step_marks_and_its_module_the_compiled_parts():
    """Under DDP the runner calls the wrapper's train/val/test steps (mmengine's DDP wrapper does not
    call the module's), so the CUDA-graph step marks go there; the parts compiled are the module's."""
    from mmengine.registry import MODEL_WRAPPERS

    class StepWrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def train_step(self, data, optim_wrapper):
            return self.module.train_step(data, optim_wrapper)

        def val_step(self, data):
            return self.module.val_step(data)

        def test_step(self, data):
            return self.module.test_step(data)

    MODEL_WRAPPERS.register_module(module=StepWrapper, force=True)
    try:
        model, _ = tiny_model()
        wrapper = StepWrapper(model)
        names = fast_training.compile_fast_path_modules(wrapper, mode="reduce-overhead", backend="aot_eager")
        assert names == ["backbone", "neck", "decoder", "encoder.layers.0"]
        assert all(getattr(wrapper, name)._marks_cuda_graph_steps for name in fast_training.STEP_METHODS)
        assert not hasattr(model.train_step, "_marks_cuda_graph_steps")
    finally:
        MODEL_WRAPPERS._module_dict.pop("StepWrapper", None)
