"""GGUF files: lossless conversion of the 32-weight block types and Q5_K to the affine format
(checked against gguf.quants.dequantize), K-quant tensors to GGUFLinear, and malformed files."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from gguf_helpers import assert_matches_reference, k_quant_magnitude, random_iq4_blocks, random_k_blocks, set_lattice_d, write_gguf
from torch_qmm import reference
from torch_qmm.interop import GGUFLinear
from torch_qmm.interop.gguf import (GGUFFile, affine_exact, dequantize, embedding_from_gguf, k_quant_to_affine,
                                    linear_from_gguf, to_affine, to_blocks)
from torch_qmm.interop.modules import QuantEmbedding
from torch_qmm.nn import QuantLinear

LOSSLESS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
EXPECTED_BITS = {T.Q8_0: 8, T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """One file with every type torch_qmm reads; returns (path, {name: (reference float64, type)})."""
    rng = np.random.default_rng(0)
    tensors, expected = {}, {}
    for t in LOSSLESS:
        w = rng.standard_normal((37, 192)).astype(np.float32) * 0.1
        q = quants.quantize(w, t)
        tensors[t.name] = (q, t)
        expected[t.name] = (torch.from_numpy(quants.dequantize(q, t)).double(), t)
    for t in (T.Q4_K, T.Q5_K, T.Q6_K):
        q = random_k_blocks(t, 19, 512, rng)
        tensors[t.name] = (q, t)
        expected[t.name] = (torch.from_numpy(quants.dequantize(q, t)).double(), t)
    w16 = (rng.standard_normal((11, 64)) * 0.1).astype(np.float16)
    tensors["F16"] = (w16, None)
    expected["F16"] = (torch.from_numpy(w16.astype(np.float64)), T.F16)
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    write_gguf(path, tensors)
    return path, expected


@pytest.mark.parametrize("qtype", LOSSLESS, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_types_convert_losslessly_to_affine(gguf_file, qtype, dtype):
    path, expected = gguf_file
    t = GGUFFile(path).tensors[qtype.name]
    wq, scales, biases, bits, gs = to_affine(t, dtype)
    assert (bits, gs) == (EXPECTED_BITS[qtype], 32) and scales.dtype == dtype
    w_ref = expected[qtype.name][0]
    assert torch.equal(reference.dequantize(wq, scales, biases, bits, gs), w_ref)  # bit-exact decode
    # and our kernel multiplies by exactly those weights
    x = torch.randn(3, 192).to(dtype)
    layer = linear_from_gguf(t, dtype=dtype)
    assert isinstance(layer, QuantLinear)
    xd = x.double()
    assert_matches_reference(layer(x), xd @ w_ref.T, xd.abs() @ w_ref.abs().T, dtype, qtype.name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_q5_k_has_an_affine_5_bit_group_32_form_exact_in_float32(gguf_file, dtype):
    # Q5_K: each sub-block of 32 is one affine group, scale d*sc and bias -dmin*m (products of a
    # float16 and a 6-bit integer, up to 17 significant bits): exact in float32, rounded below it.
    path, expected = gguf_file
    t = GGUFFile(path).tensors["Q5_K"]
    wq, scales, biases, bits, gs = to_affine(t, dtype)
    assert (bits, gs) == (5, 32) and scales.dtype == biases.dtype == dtype
    w_file = expected["Q5_K"][0]  # the gguf package's decode: d*sc*q - dmin*m in float32
    if dtype == torch.float32:
        assert affine_exact(t, dtype)
        # gguf rounds d*sc*q - dmin*m once to float32, as dequantize_rounded does with float32 scales
        assert torch.equal(reference.dequantize_rounded(wq, scales, biases, bits, gs).double(), w_file)
    else:
        assert not affine_exact(t, dtype)
        wq32, s32, b32, _, _ = to_affine(t)  # the same codes; the float32 scales rounded once
        assert torch.equal(wq, wq32) and torch.equal(scales, s32.to(dtype)) and torch.equal(biases, b32.to(dtype))
    # k_quant_to_affine gives the same form from the block bytes (what convert uses for GGUFLinear)
    kq, ks, kb = k_quant_to_affine(to_blocks(t), *t.shape, 13, dtype)
    assert torch.equal(kq, wq) and torch.equal(ks, scales) and torch.equal(kb, biases)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    layer = QuantLinear(512, 19, bits=5, group_size=32, dtype=dtype)
    layer.qweight.copy_(wq)
    layer.scales.copy_(scales)
    layer.biases.copy_(biases)
    assert_matches_reference(layer(x), reference.qmm(x, wq, scales, biases, bits, gs),
                             reference.qmm_magnitude(x, wq, scales, biases, bits, gs), dtype, "Q5_K")


def _iq4_edge_blocks(qtype) -> np.ndarray:
    """IQ4_NL / IQ4_XS rows [rows, bytes] holding every code at every position of a sub-block,
    every 6-bit sub-block scale l (IQ4_XS; l - 32 from -32 to 31), and d from subnormal to 65504."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 16, 512 // per_block
    b = np.zeros((rows, blocks_per_row, block_bytes), np.uint8)
    qs = b[..., 2:] if qtype == T.IQ4_NL else b[..., 8:]
    codes = (np.arange(rows)[:, None, None] + np.arange(qs.shape[-1])[None, None, :]) % 16  # byte j: codes c, c + 1
    qs[...] = (codes | (((codes + 1) % 16) << 4)).astype(np.uint8)
    d = np.array([6e-8, 1e-4, -3e-3, 0.5, 65504.0, -65504.0, 1.0, 2.0 ** -14] * 2, dtype="<f2")
    b[..., 0:2] = d[:, None, None].view(np.uint8).reshape(rows, 1, 2)
    if qtype == T.IQ4_XS:  # sub-block j of super-block s of row r: l = (8 * (s + r) + j) % 64
        ls = (8 * (np.arange(blocks_per_row)[None, :, None] + np.arange(rows)[:, None, None])
              + np.arange(8)[None, None, :]) % 64
        b[..., 4:8] = (ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)
        high = sum(((ls[..., j] >> 4) & 3).astype(np.uint16) << (2 * j) for j in range(8))
        b[..., 2:4] = high.astype("<u2")[..., None].view(np.uint8)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_iq4_types_convert_losslessly_to_affine_8_bit(tmp_path, qtype):
    # IQ4's 4-bit codes index a table of int8 values: affine 8-bit codes value + 128, scale d
    # (IQ4_XS: d * (l - 32)), bias -128 * scale; exact in float32 (the scales have at most 16
    # significant bits, their products with 8-bit codes at most 24)
    blocks = _iq4_edge_blocks(qtype)
    write_gguf(tmp_path / "iq4.gguf", {"w": (blocks, qtype)})
    t = GGUFFile(tmp_path / "iq4.gguf").tensors["w"]
    want = torch.from_numpy(quants.dequantize(blocks, qtype)).double()
    wq, scales, biases, bits, group_size = to_affine(t, torch.float32)
    assert (bits, group_size) == (8, 32)
    assert torch.equal(reference.dequantize(wq, scales, biases, bits, group_size), want)
    layer = linear_from_gguf(t)  # IQ4_NL: the affine 8-bit kernel; IQ4_XS: gguf_qmm on the file's blocks
    assert torch.equal(layer(torch.eye(512)).T.double(), want)
    assert torch.equal(embedding_from_gguf(t)(torch.arange(16)).double(), want)
    # float16: -128 * 65504 overflows; IQ4_XS's 16-bit scales round
    with pytest.raises(ValueError, match="overflow torch.float16; convert with dtype=torch.float32"):
        to_affine(t, torch.float16)


def test_q5_k_embedding_rows_are_the_file_weights(gguf_file):
    t = GGUFFile(gguf_file[0]).tensors["Q5_K"]
    emb = embedding_from_gguf(t)
    assert isinstance(emb, QuantEmbedding) and (emb.bits, emb.group_size) == (5, 32)
    ids = torch.tensor([[0, 18, 5, 5]])
    assert torch.equal(emb(ids).double(), gguf_file[1]["Q5_K"][0][ids])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quants_become_gguf_linear_with_the_file_bytes(gguf_file, qtype):
    path, expected = gguf_file
    t = GGUFFile(path).tensors[qtype.name]
    layer = linear_from_gguf(t)
    assert isinstance(layer, GGUFLinear) and layer.blocks.shape == (19, 512 // 256 * GGML_QUANT_SIZES[qtype][1])
    # the blocks are the bytes gguf's own reader finds in the file, bit for bit
    from gguf import GGUFReader

    raw = {r.name: r for r in GGUFReader(path).tensors}[qtype.name]
    assert torch.equal(layer.blocks, torch.from_numpy(np.array(raw.data, dtype=np.uint8).reshape(layer.blocks.shape)))
    w_ref = expected[qtype.name][0]
    x = torch.randn(4, 512)
    xd = x.double()
    assert_matches_reference(layer(x), xd @ w_ref.T, k_quant_magnitude(x, layer.blocks, qtype), torch.float32, qtype.name)


def test_float_tensors_and_embeddings(gguf_file):
    path, expected = gguf_file
    f = GGUFFile(path)
    assert torch.equal(dequantize(f.tensors["F16"]).double(), expected["F16"][0])
    emb = embedding_from_gguf(f.tensors["Q8_0"])
    assert isinstance(emb, QuantEmbedding)
    ids = torch.tensor([[0, 36, 5]])
    assert torch.equal(emb(ids).double(), expected["Q8_0"][0][ids])
    ids = torch.tensor([[0, 18, 5]])
    # Q4_K in float32: its exact affine form (4 bits, groups of 32), rows as gguf decodes them
    emb_k = embedding_from_gguf(f.tensors["Q4_K"])
    assert isinstance(emb_k, QuantEmbedding) and (emb_k.bits, emb_k.group_size) == (4, 32)
    assert torch.equal(emb_k(ids).double(), expected["Q4_K"][0][ids])
    # in bfloat16 (whose scales would round) and for Q6_K: decoded once into an nn.Embedding
    emb_bf16 = embedding_from_gguf(f.tensors["Q4_K"], dtype=torch.bfloat16)
    assert type(emb_bf16) is torch.nn.Embedding
    assert torch.equal(emb_bf16(ids), expected["Q4_K"][0][ids].to(torch.bfloat16))
    emb_6 = embedding_from_gguf(f.tensors["Q6_K"])
    assert type(emb_6) is torch.nn.Embedding and torch.equal(emb_6(ids).double(), expected["Q6_K"][0][ids])


def test_q4_k_embedding_with_a_nan_scale_is_refused_naming_the_tensor(tmp_path):
    blocks = random_k_blocks(T.Q4_K, 8, 512, np.random.default_rng(3))
    blocks[5, 144 + 2:144 + 4] = np.array([np.nan], dtype="<f2").view(np.uint8)  # dmin of row 5, block 1
    write_gguf(tmp_path / "nan.gguf", {"token_embd.weight": (blocks, T.Q4_K)})
    from torch_qmm.interop.gguf_header import GGUFFormatError

    with pytest.raises(GGUFFormatError, match=r"nan.gguf: tensor 'token_embd.weight' \(Q4_K\): embedding_from_gguf: "
                                              r"the blocks have non-finite float16 d/dmin"):
        embedding_from_gguf(GGUFFile(tmp_path / "nan.gguf").tensors["token_embd.weight"])


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_block_tensors_decode_a_slice_of_rows_at_a_time(gguf_file, monkeypatch, qtype):
    # The gguf package's decode holds several arrays of the float32 size of its input at once: a
    # whole table (a float embedding decoded from Q6_K) would peak at ~5x the table.
    import torch_qmm.interop.gguf as gguf_module

    path, expected = gguf_file
    budget = 4 * 512 * 5  # float32 bytes: 5 rows of 512 (Q6_K), 13 of 192 (Q4_1)
    monkeypatch.setattr(gguf_module, "DECODE_SLICE_BYTES", budget)
    decode, decoded = quants.dequantize, []

    def recording(data, qt):
        decoded.append(data.shape[0])
        return decode(data, qt)

    monkeypatch.setattr(quants, "dequantize", recording)
    t = GGUFFile(path).tensors[qtype.name]
    got = dequantize(t)
    assert got.dtype == torch.float32 and torch.equal(got.double(), expected[qtype.name][0])
    assert sum(decoded) == t.shape[0] and len(decoded) > 1
    assert max(decoded) * 4 * t.shape[1] <= budget, decoded


def test_float16_overflow_is_reported(tmp_path):
    # Q8_0 with d = 1024: the bias -128*d overflows float16 (exact in float32).
    block = np.zeros((1, 34), dtype=np.uint8)
    block[0, 0:2] = np.array([1024.0], dtype="<f2").view(np.uint8)
    write_gguf(tmp_path / "big.gguf", {"w": (block, T.Q8_0)})
    t = GGUFFile(tmp_path / "big.gguf").tensors["w"]
    to_affine(t, torch.float32)
    with pytest.raises(ValueError, match="overflow torch.float16; convert with dtype=torch.float32"):
        to_affine(t, torch.float16)


# ---- bad input --------------------------------------------------------------------------------

def test_unsupported_gguf_type_lists_the_supported_ones(tmp_path):
    write_gguf(tmp_path / "tq2.gguf", {"w": (np.zeros((4, 66), dtype=np.uint8), T.TQ2_0)})
    t = GGUFFile(tmp_path / "tq2.gguf").tensors["w"]
    assert t.type_name == "TQ2_0" and t.shape == (4, 256)
    with pytest.raises(ValueError, match=r"type TQ2_0; .* \(torch_qmm reads: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                                         r"Q8_0, Q5_K, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q6_K, IQ2_XXS, IQ2_XS, IQ3_XXS, "
                                         r"IQ1_S, IQ3_S, IQ2_S, IQ1_M, MXFP4\)"):
        linear_from_gguf(t)


def test_truncated_gguf_is_a_clear_error(gguf_file, tmp_path):
    data = gguf_file[0].read_bytes()
    for cut, message in [(len(data) - 4096, "truncated"), (60, "truncated"), (20, "truncated"), (3, "not a GGUF file")]:
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=message):
            GGUFFile(tmp_path / "cut.gguf")


def test_a_tensor_name_of_63_bytes_is_read(tmp_path):
    # llama.cpp's GGML_MAX_NAME is 64 bytes with the terminating zero: 63-byte names are valid.
    name = "blk.0." + "n" * 50 + ".weight"
    assert len(name.encode()) == 63
    w = (np.arange(64, dtype=np.float32) / 7).reshape(2, 32)
    write_gguf(tmp_path / "long.gguf", {name: (w, None)})
    assert torch.equal(dequantize(GGUFFile(tmp_path / "long.gguf").tensors[name]), torch.from_numpy(w))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"not a GGUF file \(starts with b'PK\\x03\\x04'"):
        GGUFFile(tmp_path / "x.gguf")


def test_header_sizes_disagreeing_with_the_data_are_an_error(tmp_path):
    # Rewrite the tensor-info dims of the last tensor so it claims more rows than the file holds.
    q = quants.quantize(np.ones((4, 64), dtype=np.float32), T.Q8_0)
    write_gguf(tmp_path / "a.gguf", {"only": (q, T.Q8_0)})
    data = bytearray((tmp_path / "a.gguf").read_bytes())
    at = data.index(b"only") + 4  # then: n_dims u32, ne0 u64, ne1 u64
    assert int.from_bytes(data[at:at + 4], "little") == 2
    data[at + 12:at + 20] = (400).to_bytes(8, "little")  # ne1 = N: 4 -> 400 rows
    (tmp_path / "a.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"a\.gguf: tensor 'only'.*truncated"):
        GGUFFile(tmp_path / "a.gguf")


def test_gguf_linear_state_carries_its_type_and_another_type_is_refused(tmp_path):
    """Q4_K with in_features=8960 and Q6_K with 6144 have blocks of the same shape [N, 5040]."""
    from safetensors.torch import load_file, save_file

    from gguf_helpers import random_k_blocks

    q4 = GGUFLinear(8960, 2, int(T.Q4_K), bias=True)
    q4.blocks.copy_(torch.from_numpy(random_k_blocks(T.Q4_K, 2, 8960, np.random.default_rng(0))))
    q6 = GGUFLinear(6144, 2, int(T.Q6_K), bias=True)
    assert q4.blocks.shape == q6.blocks.shape
    save_file(q4.state_dict(), tmp_path / "q4.safetensors")
    state = load_file(tmp_path / "q4.safetensors")
    assert state["_extra_state"].tolist() == [int(T.Q4_K)]
    before = {k: v.clone() for k, v in q6.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds ggml_type=12 \(Q4_K\), this layer has ggml_type=14 \(Q6_K\)"):
        q6.load_state_dict(state)
    assert all(torch.equal(before[k], v) for k, v in q6.state_dict().items())  # left unchanged
    same = GGUFLinear(8960, 2, int(T.Q4_K), bias=True)
    same.load_state_dict(state)
    x = torch.randn(3, 8960)
    assert torch.equal(same(x), q4(x))
    with pytest.raises(ValueError, match=r"format state must be an integer tensor \[1\] \(ggml_type\)"):
        same.load_state_dict({**state, "_extra_state": torch.tensor([12, 32], dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"integer tensor \[2\] \(bits, group_size\) or \[10\] \(bits, group_size, mode name\), got torch.int32 \[1\]"):
        QuantLinear(256, 2, bits=4, group_size=64).load_state_dict(state, strict=False)


# ---- bfloat16 tensors, biases, corrupt block scales ----------------------------------------------

def test_bf16_tensors_decode_as_gguf_decodes_them(tmp_path):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 64)) * 3).astype(np.float32)
    w[0, :4] = [2.0**-133, -(2.0**100), 1.0 + 2.0**-7, -0.0]  # a subnormal, a large value, the last bit, -0
    raw = quants.quantize(w, T.BF16)
    write_gguf(tmp_path / "bf16.gguf", {"w": (raw, T.BF16)})
    t = GGUFFile(tmp_path / "bf16.gguf").tensors["w"]
    want = torch.from_numpy(quants.dequantize(raw, T.BF16).astype(np.float32))
    assert t.type_name == "BF16" and t.shape == (6, 64)
    got = dequantize(t)
    assert got.dtype == torch.float32 and torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    layer = linear_from_gguf(t)  # a float layer holding exactly those weights
    assert type(layer) is torch.nn.Linear and torch.equal(layer.weight.detach(), want)


def test_bf16_tensor_with_a_nan_is_refused_as_corrupt(tmp_path):
    raw = quants.quantize(np.ones((2, 32), np.float32), T.BF16)
    raw.view(np.uint16)[1, 5] = 0x7FC0  # a bfloat16 NaN
    write_gguf(tmp_path / "nan.gguf", {"w": (raw, T.BF16)})
    from torch_qmm.interop.gguf_header import GGUFFormatError

    with pytest.raises(GGUFFormatError, match=r"tensor 'w' \(BF16\) holds NaN or Inf values: the file is corrupt"):
        dequantize(GGUFFile(tmp_path / "nan.gguf").tensors["w"])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.F16], ids=lambda t: t.name)
def test_linear_from_gguf_adds_the_bias(gguf_file, qtype):
    path, expected = gguf_file
    t = GGUFFile(path).tensors[qtype.name]
    n, k = t.shape
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    layer = linear_from_gguf(t, bias=bias)
    assert layer.bias is not None and torch.equal(layer.bias.detach(), bias)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    w_ref = expected[qtype.name][0]
    xd = x.double()
    magnitude = (k_quant_magnitude(x, layer.blocks, qtype) if qtype == T.Q4_K else xd.abs() @ w_ref.abs().T)
    # The bias is added after the float32 product: one more rounding, within the same bound.
    assert_matches_reference(layer(x), xd @ w_ref.T + bias.double(), magnitude + bias.double().abs(),
                             torch.float32, qtype.name)


@pytest.mark.parametrize("qtype, scale_byte", [(T.Q4_0, 0), (T.Q4_K, 2), (T.Q5_K, 0), (T.Q5_K, 2), (T.Q6_K, 208),
                                               (T.IQ4_NL, 0), (T.IQ4_XS, 0), (T.IQ2_XXS, 0), (T.IQ3_S, 0),
                                               (T.IQ1_M, None)], ids=lambda v: str(v))
def test_block_scales_that_are_not_finite_are_refused_as_corrupt(tmp_path, qtype, scale_byte):
    from torch_qmm.interop.gguf_header import GGUFFormatError

    rng = np.random.default_rng(6)
    if qtype == T.Q4_0:
        blocks = quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype)
    elif qtype in (T.IQ4_NL, T.IQ4_XS):
        blocks = random_iq4_blocks(qtype, 2, 256, rng)
    else:
        blocks = random_k_blocks(qtype, 2, 256, rng)
    blocks = np.ascontiguousarray(blocks).copy()
    if scale_byte is None:  # IQ1_M: d is the top nibbles of its 4 scale uint16
        set_lattice_d(blocks.reshape(2, 1, -1)[1:, :, :56], qtype, np.array([[np.inf]]))
    else:
        blocks[1, scale_byte:scale_byte + 2] = np.array([np.inf], dtype="<f2").view(np.uint8)  # row 1's first block
    write_gguf(tmp_path / "bad.gguf", {"w": (blocks, qtype)})
    t = GGUFFile(tmp_path / "bad.gguf").tensors["w"]
    with pytest.raises(GGUFFormatError, match=rf"tensor 'w' \({qtype.name}\) holds NaN or Inf block scales"):
        linear_from_gguf(t)


def _patched_gguf(path, tensor_name="w", strings=(), arrays=(), old=None, new=None):
    """A one-tensor GGUF with string / string-array metadata; `old` bytes (first match after the
    magic) replaced by `new` of the same length."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for k, v in strings:
        w.add_string(k, v)
    for k, v in arrays:
        w.add_array(k, v)
    w.add_tensor(tensor_name, np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if old is not None:
        data = path.read_bytes()
        i = data.index(old, 4)
        path.write_bytes(data[:i] + new + data[i + len(old):])
    return path


def test_gguf_headers_llama_cpp_refuses_are_refused_naming_what_is_wrong(tmp_path):
    from torch_qmm.interop.gguf_header import GGUFFormatError

    dup = _patched_gguf(tmp_path / "dup.gguf", strings=[("aa.x", "1"), ("aa.y", "2")], old=b"aa.y", new=b"aa.x")
    with pytest.raises(GGUFFormatError, match=r"dup.gguf: duplicate metadata key 'aa.x'"):
        GGUFFile(dup)
    long = _patched_gguf(tmp_path / "long.gguf", tensor_name="n" * 64)
    with pytest.raises(GGUFFormatError, match=r"long.gguf: tensor #0 name 'n{64}' is longer than 63 bytes"):
        GGUFFile(long)
    bad = _patched_gguf(tmp_path / "utf8.gguf", arrays=[("t.list", ["ab", "cd"])], old=b"cd", new=b"\xff\xfe")
    f = GGUFFile(bad)  # metadata values are read when asked for
    with pytest.raises(GGUFFormatError, match=r"metadata 't.list' holds a string that is not valid UTF-8: b'\\xff\\xfe'"):
        f.get_metadata("t.list")
    good = GGUFFile(_patched_gguf(tmp_path / "good.gguf", arrays=[("t.list", ["ab", "cd"])]))
    assert good.get_metadata("t.list") == ["ab", "cd"]


@pytest.mark.parametrize("ggml_type", ["Q4_K", 12.0, None, True], ids=repr)
def test_gguf_linear_ggml_type_that_is_not_an_int_is_a_type_error(ggml_type):
    """A type name or a float is refused naming the argument (a name failed as "invalid literal for
    int()", 12.0 built a layer whose forward failed); gguf's IntEnum is its value."""
    with pytest.raises(TypeError, match=rf"argument 'ggml_type' must be an int, one of 10 \(Q2_K\), 11 \(Q3_K\), 12 \(Q4_K\), 13 \(Q5_K\), 14 \(Q6_K\), "
                                        r"16 \(IQ2_XXS\), 17 \(IQ2_XS\), 18 \(IQ3_XXS\), 19 \(IQ1_S\), 21 \(IQ3_S\), "
                                        r"22 \(IQ2_S\), 23 \(IQ4_XS\), 29 \(IQ1_M\), "
                                        rf"got {re.escape(repr(ggml_type))}"):
        GGUFLinear(256, 8, ggml_type)
    layer = GGUFLinear(256, 8, T.Q6_K)
    assert type(layer.ggml_type) is int and layer.state_dict()["_extra_state"].tolist() == [14]
