"""The reduction plan the three engines share (mgpu_launch.backends.reduction), on plain numbers.

No framework: these run without TensorFlow, JAX or torch installed, and one test proves the
module loads in an interpreter that sees no third-party package at all.
"""

import doctest
import json
import os
import random
import subprocess
import sys

import pytest

from mgpu_launch.backends import reduction
from mgpu_launch.backends.reduction import Bucket, Scales, TensorSpec, plan, scale_once, scales

MODULE = os.path.abspath(reduction.__file__)
F32, F16, BF16 = "float32", "float16", "bfloat16"


def indices(buckets):
    return [b.indices for b in buckets]


def spec(dtype, size):
    return TensorSpec(dtype, size, {F32: 4, F16: 2, BF16: 2, "int64": 8}[dtype])


# -- framework-free ---------------------------------------------------------------------------
def test_the_module_needs_no_third_party_package():
    # -I -S: no site-packages, no PYTHONPATH; the file is loaded on its own, outside the package.
    code = (
        "import importlib.util, sys\n"
        f"location = importlib.util.spec_from_file_location('reduction', {MODULE!r})\n"
        "module = importlib.util.module_from_spec(location)\n"
        "location.loader.exec_module(module)\n"
        "print([b.indices for b in module.plan([('float32', 3, 4), ('float16', 1, 2)])])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('numpy', 'keras', 'tensorflow', 'jax', 'torch')))\n")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[(1,), (0,)]", "[]"]


def test_importing_it_through_the_package_loads_no_framework():
    code = ("import sys\nfrom mgpu_launch.backends import reduction\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('keras', 'tensorflow', 'jax', 'torch')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_docstring_examples_hold():
    failed, tried = doctest.testmod(reduction)
    assert tried >= 3 and failed == 0


# -- the plan ---------------------------------------------------------------------------------
def test_an_empty_list_has_no_buckets():
    assert plan([]) == []
    assert plan([], 64, backward=True) == []


def test_without_a_limit_each_dtype_is_one_bucket_in_list_order():
    specs = [spec(F32, 3), spec(F16, 5), spec(F32, 2), spec(F16, 1)]
    assert plan(specs) == [Bucket(F16, (1, 3), (5, 1), (0, 5)), Bucket(F32, (0, 2), (3, 2), (0, 3))]


def test_backward_fills_from_the_last_tensor():
    specs = [spec(F32, 3), spec(F16, 5), spec(F32, 2), spec(F16, 1)]
    assert indices(plan(specs, backward=True)) == [(3, 1), (2, 0)]


def test_a_bucket_closes_once_it_reaches_the_limit():
    specs = [spec(F32, 4)] * 5  # 16 bytes each
    assert indices(plan(specs, 32)) == [(0, 1), (2, 3), (4,)]
    assert indices(plan(specs, 33)) == [(0, 1, 2), (3, 4)]
    assert indices(plan(specs, 32, backward=True)) == [(4, 3), (2, 1), (0,)]


def test_a_tensor_larger_than_a_bucket_is_never_split():
    big = spec(F32, 1000)
    assert plan([big], 64) == [Bucket(F32, (0,), (1000,), (0,))]
    # It joins the partly filled bucket before it and closes it; the next one starts afresh.
    assert indices(plan([spec(F32, 2), big, spec(F32, 2)], 64)) == [(0, 1), (2,)]


@pytest.mark.parametrize("bucket_bytes", [0, -1])
def test_a_limit_of_zero_or_less_is_no_fusion(bucket_bytes):
    specs = [spec(F32, 3), spec(F16, 5), spec(F32, 0), spec(F32, 2)]
    assert indices(plan(specs, bucket_bytes)) == [(1,), (0,), (2,), (3,)]


def test_empty_tensors_take_part_without_bytes():
    assert plan([spec(F32, 0), spec(F32, 4), spec(F32, 0)], 16) == [
        Bucket(F32, (0, 1), (0, 4), (0, 0)), Bucket(F32, (2,), (0,), (0,))]


def test_mixed_dtypes_are_bucketed_apart_in_name_order():
    specs = [spec("int64", 1), spec(F32, 8), spec(BF16, 8), spec(F16, 8), spec(F32, 8)]
    buckets = plan(specs, 32)
    assert [b.dtype for b in buckets] == [BF16, F16, F32, F32, "int64"]
    assert indices(buckets) == [(2,), (3,), (1,), (4,), (0,)]


def test_a_compressed_wire_fits_twice_the_elements():
    # JAX plans the already compressed tensors: fp16 on the wire halves the bytes, so the
    # float32 and float16 gradients share the float16 buckets.
    sizes = [8, 8, 8, 8]
    as_is = plan([spec(F32, n) for n in sizes], 64)
    on_fp16_wire = plan([spec(F16, n) for n in sizes], 64)
    assert indices(as_is) == [(0, 1), (2, 3)]
    assert indices(on_fp16_wire) == [(0, 1, 2, 3)]


def test_offsets_and_sizes_cut_each_buffer_into_its_tensors():
    rng = random.Random(3)
    for _ in range(500):
        specs = [spec(rng.choice([F32, F16, BF16]), rng.randint(0, 50))
                 for _ in range(rng.randint(0, 12))]
        buckets = plan(specs, rng.choice([None, 0, 8, 64, 500]), backward=rng.random() < 0.5)
        seen = sorted(i for b in buckets for i in b.indices)
        assert seen == list(range(len(specs)))
        for bucket in buckets:
            assert all(specs[i].dtype == bucket.dtype for i in bucket.indices)
            assert bucket.sizes == tuple(specs[i].size for i in bucket.indices)
            ends = [o + n for o, n in zip(bucket.offsets, bucket.sizes)]
            assert bucket.offsets == (0,) + tuple(ends[:-1])
            assert bucket.size == ends[-1] == sum(bucket.sizes)


def test_plain_tuples_work_as_specs():
    assert plan([("torch.float32", 2, 4)]) == [Bucket("torch.float32", (0,), (2,), (0,))]


def test_a_negative_size_is_refused_with_the_tensor_named():
    with pytest.raises(ValueError, match=r"tensor 1 .* size=-3 .* expected"):
        plan([spec(F32, 1), TensorSpec(F32, -3, 4)])


# -- the cross-rank contract ------------------------------------------------------------------
def test_the_dtype_order_does_not_depend_on_which_comes_first():
    one = plan([spec(F32, 1), spec(F16, 1)])
    other = plan([spec(F16, 1), spec(F32, 1)])
    assert [b.dtype for b in one] == [b.dtype for b in other] == [F16, F32]


def test_torch_dtype_names_order_like_the_plain_names():
    plain = [F32, F16, BF16]
    torch_names = [f"torch.{name}" for name in plain]
    assert [b.indices for b in plan([TensorSpec(n, 1, 2) for n in plain])] == \
        [b.indices for b in plan([TensorSpec(n, 1, 2) for n in torch_names])]


def test_the_plan_is_the_same_in_every_process():
    # Ranks are separate interpreters with their own string hash seeds: the plan must not
    # depend on hash order (a set or dict of dtypes iterated without sorting would).
    code = ("import json, sys\nfrom mgpu_launch.backends.reduction import plan\n"
            "specs = json.loads(sys.argv[1])\n"
            "print(json.dumps([list(b) for b in plan(specs, 64, backward=True)]))\n")
    rng = random.Random(7)
    names = ["float32", "float16", "bfloat16", "float64", "int32", "int8", "uint8", "int64"]
    specs = [[rng.choice(names), rng.randint(0, 40), 4] for _ in range(40)]
    plans = set()
    for seed in ("0", "1", "2", "12345"):
        done = subprocess.run([sys.executable, "-c", code, json.dumps(specs)],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        plans.add(done.stdout)
    assert len(plans) == 1
    expected = json.dumps([list(b) for b in plan(specs, 64, backward=True)]) + "\n"
    assert plans == {expected}


# -- the arithmetic ---------------------------------------------------------------------------
def test_average_divides_the_postscale_by_the_ranks():
    assert scales(average=True, size=4) == Scales(1.0, 0.25)
    assert scales(average=True, size=3, prescale=0.5, postscale=2.0) == Scales(0.5, 2.0 / 3)


def test_sum_keeps_the_factors():
    assert scales(average=False, size=4) == Scales(1.0, 1.0)
    assert scales(average=False, size=4, prescale=0.5, postscale=3.0) == Scales(0.5, 3.0)


def test_predivide_factors_come_back_unchanged():
    # DistributedOptimizer(gradient_predivide_factor=f): prescale 1/f, postscale f.
    factor = 3.0
    pre, post = scales(True, 2, 1.0 / factor, factor)
    assert pre == 1.0 / factor and post == factor / 2


def test_gathered_values_are_scaled_once_by_both_factors():
    assert scale_once(average=True, size=4, prescale=0.5, postscale=3.0) == 0.5 * 3.0 / 4
    assert scale_once(average=False, size=4, prescale=0.5, postscale=3.0) == 1.5
    assert scale_once(average=True, size=1) == 1.0


@pytest.mark.parametrize("size", [0, -2, 1.5, True, "2"])
def test_a_bad_number_of_ranks_is_refused(size):
    with pytest.raises(ValueError, match=r"size=.*expected the number of ranks"):
        scales(True, size)
    with pytest.raises(ValueError, match=r"size=.*expected the number of ranks"):
        scale_once(True, size)


def test_numpy_integers_count_as_a_number_of_ranks():
    np = pytest.importorskip("numpy")
    assert scales(True, np.int64(4)).post == 0.25


def test_tensor_spec_bytes():
    assert TensorSpec(F16, 10, 2).nbytes == 20
