#!/usr/bin/python3
"""Writes the tiny random-weight GGUF models the llama integration's tests run.

    PYTHONPATH=<llama.cpp>/gguf-py /usr/bin/python3 make_models.py OUT_DIR [ARCH...]

ARCH is any of llama, kimi-k3, deepseek4 (default: all three); each becomes OUT_DIR/ARCH.gguf.
The weights are f32 draws from a generator seeded by the architecture and the tensor's name,
so a file's bytes depend on nothing but this script and the gguf-py it runs with: the same
on every run. The models compute nothing useful; they exercise the same memory classes as
the real models (a plain KV cache; KDA recurrent layers beside MLA attention; DeepSeek-V4's
sliding window, compressed caches and compressor states) at a size that decodes in
milliseconds on a CPU.
"""
import hashlib
import os
import sys

import numpy as np
import gguf

SEED = 20260912
VOCAB = 320


def stream(arch, name):
    # One generator per tensor: adding a tensor never changes another tensor's bytes.
    digest = hashlib.sha256(f"{SEED}/{arch}/{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


class Model:
    """Collects one architecture's metadata calls and tensors, then writes the file."""

    def __init__(self, arch, path):
        self.arch = arch
        self.path = path
        self.writer = gguf.GGUFWriter(path, arch)
        self.tensors = []
        self.writer.add_name(f"kvfuse-tiny-{arch}")
        self.writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        self.writer.add_vocab_size(VOCAB)
        self.writer.add_context_length(4096)
        self._vocab()

    def _vocab(self):
        # A SentencePiece-style vocabulary: three specials, 256 byte tokens, then fillers.
        # The tests feed token ids directly, so only its shape matters.
        names = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % b for b in range(256)]
        kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
        while len(names) < VOCAB:
            names.append(("\u2581w%d" % len(names)).encode())
            kinds.append(gguf.TokenType.NORMAL)
        w = self.writer
        w.add_tokenizer_model("llama")
        w.add_token_list(names)
        w.add_token_scores([-float(i) for i in range(VOCAB)])
        w.add_token_types(kinds)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)

    def weight(self, name, *ne, scale=0.15):
        """A normal(0, scale) tensor; `ne` in ggml order (ne[0] varies fastest)."""
        values = stream(self.arch, name).standard_normal(tuple(reversed(ne))) * scale
        self.tensors.append((name, values.astype(np.float32)))

    def norm(self, name, n):
        """A norm weight near one."""
        values = 1.0 + 0.1 * stream(self.arch, name).standard_normal(n)
        self.tensors.append((name, values.astype(np.float32)))

    def const(self, name, values):
        self.tensors.append((name, np.asarray(values, dtype=np.float32)))

    def embeddings(self, n_embd):
        self.weight("token_embd.weight", n_embd, VOCAB, scale=1.0)
        self.norm("output_norm.weight", n_embd)
        self.weight("output.weight", n_embd, VOCAB, scale=1.0)

    def write(self):
        for name, values in self.tensors:
            self.writer.add_tensor(name, values)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


def dense_llama(m):
    """Two layers of grouped-query attention: 4 query heads, 2 KV heads of 32."""
    n_embd, n_head, n_head_kv, n_ff, n_layer = 128, 4, 2, 256, 2
    head = n_embd // n_head
    w = m.writer
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    m.embeddings(n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        m.norm(b + "attn_norm.weight", n_embd)
        m.weight(b + "attn_q.weight", n_embd, n_head * head)
        m.weight(b + "attn_k.weight", n_embd, n_head_kv * head)
        m.weight(b + "attn_v.weight", n_embd, n_head_kv * head)
        m.weight(b + "attn_output.weight", n_head * head, n_embd)
        m.norm(b + "ffn_norm.weight", n_embd)
        m.weight(b + "ffn_gate.weight", n_embd, n_ff)
        m.weight(b + "ffn_up.weight", n_embd, n_ff)
        m.weight(b + "ffn_down.weight", n_ff, n_embd)


def kimi_k3(m):
    """Six layers, KDA KDA MLA KDA KDA MLA: two attention layers whose cache holds the
    compressed latent plus the rope part (K only), four recurrent KDA layers."""
    n_embd, n_head, n_layer = 64, 2, 6
    kda_head, d_conv = 32, 4
    d_inner = kda_head * n_head
    kv_lora, rope, nope, v_mla = 32, 16, 16, 16
    n_ff, n_ff_exp, n_expert, n_used, n_shared, latent = 128, 32, 4, 2, 1, 32
    attention = [False, False, True, False, False, True]
    w = m.writer
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv([1 if a else 0 for a in attention])  # 0 marks a KDA layer
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_kda_head_dim(kda_head)
    w.add_kda_gate_lower_bound(-5.0)
    w.add_kv_lora_rank(kv_lora)
    w.add_rope_dimension_count(rope)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v_mla)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_shared_count(n_shared)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_latent_length(latent)
    w.add_activation_situ_beta(4.0)
    w.add_activation_situ_linear_beta(25.0)
    w.add_attn_res_block_size(2)
    m.embeddings(n_embd)
    m.weight("output_res_score.weight", n_embd, scale=0.5)
    for i in range(n_layer):
        b = f"blk.{i}."
        m.norm(b + "attn_norm.weight", n_embd)
        m.norm(b + "ffn_norm.weight", n_embd)
        m.weight(b + "attn_res_score.weight", n_embd, scale=0.5)
        m.weight(b + "ffn_res_score.weight", n_embd, scale=0.5)
        if attention[i]:
            m.norm(b + "attn_kv_a_norm.weight", kv_lora)
            m.weight(b + "attn_q.weight", n_embd, n_head * (nope + rope))
            m.weight(b + "attn_kv_a_mqa.weight", n_embd, kv_lora + rope)
            m.weight(b + "attn_k_b.weight", nope, kv_lora, n_head, scale=0.2)
            m.weight(b + "attn_v_b.weight", kv_lora, v_mla, n_head, scale=0.2)
            m.weight(b + "attn_gate.weight", n_embd, n_head * v_mla)
            m.weight(b + "attn_output.weight", n_head * v_mla, n_embd)
        else:
            for x in "qkv":
                m.weight(b + f"ssm_conv1d_{x}.weight", d_conv, 1, d_inner, scale=0.3)
                m.weight(b + f"attn_{x}.weight", n_embd, d_inner)
            m.weight(b + "ssm_f_a.weight", n_embd, kda_head)
            m.weight(b + "ssm_f_b.weight", kda_head, d_inner)
            m.weight(b + "ssm_beta.weight", n_embd, n_head)
            m.const(b + "ssm_a", -np.exp(stream(m.arch, b + "ssm_a").uniform(-1.0, 1.0, n_head)))
            m.weight(b + "ssm_dt.bias", d_inner, scale=0.1)
            m.weight(b + "ssm_g.weight", n_embd, d_inner)
            m.norm(b + "ssm_norm.weight", kda_head)
            m.weight(b + "attn_output.weight", d_inner, n_embd)
        if i == 0:  # the leading dense block
            m.weight(b + "ffn_gate.weight", n_embd, n_ff)
            m.weight(b + "ffn_up.weight", n_embd, n_ff)
            m.weight(b + "ffn_down.weight", n_ff, n_embd)
        else:  # latent MoE
            m.weight(b + "ffn_gate_inp.weight", n_embd, n_expert, scale=0.3)
            m.weight(b + "exp_probs_b.bias", n_expert, scale=0.1)
            m.weight(b + "ffn_gate_exps.weight", latent, n_ff_exp, n_expert)
            m.weight(b + "ffn_up_exps.weight", latent, n_ff_exp, n_expert)
            m.weight(b + "ffn_down_exps.weight", n_ff_exp, latent, n_expert)
            m.weight(b + "ffn_routed_down.weight", n_embd, latent)
            m.weight(b + "ffn_routed_up.weight", latent, n_embd)
            m.norm(b + "ffn_routed_norm.weight", latent)
            m.weight(b + "ffn_gate_shexp.weight", n_embd, n_ff_exp * n_shared)
            m.weight(b + "ffn_up_shexp.weight", n_embd, n_ff_exp * n_shared)
            m.weight(b + "ffn_down_shexp.weight", n_ff_exp * n_shared, n_embd)


def deepseek4(m):
    """Five layers with compress ratios 0 4 128 4 128: every layer attends over a sliding
    window of raw K; ratio-4 layers (CSA) add rows compressed from 4 tokens and a lightning
    indexer over its own ratio-4 rows; ratio-128 layers (HCA) add rows compressed from 128."""
    n_embd, n_head, head, rope, n_layer = 128, 2, 64, 32, 5
    q_lora, o_groups, o_lora, hc = 64, 2, 32, 4
    n_expert, n_used, n_shared, n_ff_exp = 4, 2, 1, 64
    idx_heads, idx_head, idx_top_k = 4, 64, 8
    window = 128
    ratios = [0, 4, 128, 4, 128]
    hc_dim, hc_mix = hc * n_embd, (2 + hc) * hc
    w = m.writer
    w.add_embedding_length(n_embd)
    w.add_embedding_length_out(n_embd * hc)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(4 * n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(1)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_q_lora_rank(q_lora)
    w.add_sliding_window(window)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_shared_count(n_shared)
    w.add_expert_weights_scale(1.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SQRTSOFTPLUS)
    w.add_swiglu_clamp_exp([10.0] * n_layer)
    w.add_swiglu_clamp_shexp([10.0] * n_layer)
    w.add_indexer_head_count(idx_heads)
    w.add_indexer_key_length(idx_head)
    w.add_indexer_top_k(idx_top_k)
    w.add_attention_output_group_count(o_groups)
    w.add_attention_output_lora_rank(o_lora)
    w.add_attention_compress_ratios(ratios)
    w.add_attention_compress_rope_freq_base(160000.0)
    w.add_hyper_connection_count(hc)
    w.add_hyper_connection_sinkhorn_iterations(2)
    w.add_hyper_connection_epsilon(1e-6)
    w.add_hash_layer_count(0)
    m.embeddings(n_embd)
    m.weight("output_hc_fn.weight", hc_dim, hc)
    m.weight("output_hc_base.weight", hc, scale=0.1)
    m.const("output_hc_scale.weight", [1.0])
    for i, ratio in enumerate(ratios):
        b = f"blk.{i}."
        m.norm(b + "attn_norm.weight", n_embd)
        m.weight(b + "attn_sinks.weight", n_head, scale=0.5)
        m.weight(b + "attn_q_a.weight", n_embd, q_lora)
        m.norm(b + "attn_q_a_norm.weight", q_lora)
        m.weight(b + "attn_q_b.weight", q_lora, n_head * head, scale=0.1)
        m.weight(b + "attn_kv.weight", n_embd, head)
        m.norm(b + "attn_kv_a_norm.weight", head)
        m.weight(b + "attn_output_a.weight", n_head * head // o_groups, o_lora * o_groups)
        m.weight(b + "attn_output_b.weight", o_groups * o_lora, n_embd)
        for part in ("attn", "ffn"):
            m.weight(b + f"hc_{part}_fn.weight", hc_dim, hc_mix)
            m.weight(b + f"hc_{part}_base.weight", hc_mix, scale=0.1)
            m.const(b + f"hc_{part}_scale.weight", [1.0, 1.0, 1.0])
        if ratio:
            width = (2 if ratio == 4 else 1) * head  # CSA's windows overlap: two halves
            m.weight(b + "attn_compressor_kv.weight", n_embd, width)
            m.weight(b + "attn_compressor_gate.weight", n_embd, width)
            m.weight(b + "attn_compressor_ape.weight", width, ratio, scale=0.1)
            m.norm(b + "attn_compressor_norm.weight", head)
        if ratio == 4:
            m.weight(b + "indexer.proj.weight", n_embd, idx_heads)
            m.weight(b + "indexer.attn_q_b.weight", q_lora, idx_heads * idx_head, scale=0.1)
            m.weight(b + "indexer_compressor_kv.weight", n_embd, 2 * idx_head)
            m.weight(b + "indexer_compressor_gate.weight", n_embd, 2 * idx_head)
            m.weight(b + "indexer_compressor_ape.weight", 2 * idx_head, ratio, scale=0.1)
            m.norm(b + "indexer_compressor_norm.weight", idx_head)
        m.weight(b + "ffn_gate_inp.weight", n_embd, n_expert, scale=0.3)
        m.weight(b + "exp_probs_b.bias", n_expert, scale=0.1)
        m.norm(b + "ffn_norm.weight", n_embd)
        m.weight(b + "ffn_gate_exps.weight", n_embd, n_ff_exp, n_expert)
        m.weight(b + "ffn_up_exps.weight", n_embd, n_ff_exp, n_expert)
        m.weight(b + "ffn_down_exps.weight", n_ff_exp, n_embd, n_expert)
        m.weight(b + "ffn_gate_shexp.weight", n_embd, n_ff_exp * n_shared)
        m.weight(b + "ffn_up_shexp.weight", n_embd, n_ff_exp * n_shared)
        m.weight(b + "ffn_down_shexp.weight", n_ff_exp * n_shared, n_embd)


BUILDERS = {"llama": dense_llama, "kimi-k3": kimi_k3, "deepseek4": deepseek4}


def main(argv):
    if len(argv) < 2:
        sys.exit(f"usage: {argv[0]} OUT_DIR [{' '.join(BUILDERS)}]")
    out_dir, archs = argv[1], argv[2:] or list(BUILDERS)
    os.makedirs(out_dir, exist_ok=True)
    for arch in archs:
        if arch not in BUILDERS:
            sys.exit(f"make_models.py: unknown architecture '{arch}' (known: {', '.join(BUILDERS)})")
        path = os.path.join(out_dir, f"{arch}.gguf")
        # Written beside and renamed, so an interrupted run never leaves a torn model.
        model = Model(arch, path + ".part")
        BUILDERS[arch](model)
        model.write()
        os.replace(path + ".part", path)


if __name__ == "__main__":
    main(sys.argv)
