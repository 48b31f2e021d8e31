"""Random-weight GGUF files of real models' shapes, carrying the default model's tokenizer (SmolLM2's),
for measuring Loom and llama.cpp on the files users have without a model hub.

    python docs/bench/random_gguf.py --shape 1.7b --format q4_k_m --out /tmp/gguf
    python docs/bench/random_gguf.py --shape 7b --format q4_k_m --out /tmp/gguf
    python docs/bench/random_gguf.py --shape 1b --format q4_k_m --vocab 128256 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen2.5-0.5b --format q4_k_m --vocab 151936 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape gemma2-2b --format q4_k_m --vocab 256000 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape gemma-2b --format q4_k_m --vocab 256000 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape exaone4-1.2b --format q4_k_m --vocab 102400 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen3moe-30b-a3b --format q4_k_m --vocab 151936 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape ministral3-3b --format q4_k_m --vocab 131072 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape olmo3-7b --format q4_k_m --vocab 100278 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape gpt-oss-20b --format mxfp4 --vocab 201088 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen2moe-a2.7b --format q4_k_m --vocab 151936 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape ernie4_5moe-21b-a3b --format q4_k_m --vocab 103424 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape lfm2-1.2b --format q4_k_m --vocab 65536 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape lfm2moe-8b-a1b --format q4_k_m --vocab 65536 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen35-2b --format q4_k_m --vocab 248320 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape granite4h-micro --format q4_k_m --vocab 100352 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen3vl-2b --format q4_k_m --vocab 151936 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape nemotronh-4b --format q4_k_m --vocab 131072 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape deepseek2-16b --format q4_k_m --vocab 102400 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape glm47flash-30b-a3b-12l --format q4_k_m --vocab 154880 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape nemotron3-nano-30b-a3b-12l --format q4_k_m --vocab 131072 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape nemotron3-super-120b-a12b-6l --format q4_k_m --vocab 131072 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape phi2-2.7b --format q4_k_m --vocab 51200 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape command-r7b --format q4_k_m --vocab 256000 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape hunyuan-1.8b --format q4_k_m --vocab 120832 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape minitron-4b --format q4_k_m --vocab 256000 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape hunyuanmoe-a13b-4l --format q4_k_m --vocab 128167 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape dots1-142b-a14b-4l --format q4_k_m --vocab 152064 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape minimax-m2-3l --format q4_k_m --vocab 200064 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape pythia-1.4b --format q4_k_m --vocab 50304 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape falcon-7b --format q4_k_m --vocab 65024 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape afmoe-18b-8l --format q4_k_m --vocab 200192 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape apertus-8b --format q4_k_m --vocab 131072 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape starcoder-1b --format q4_k_m --vocab 49152 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape chatglm-9b --format q4_k_m --vocab 151552 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape stablelm2-12b --format q4_k_m --vocab 100352 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape dbrx-132b-2l --format q4_k_m --vocab 100352 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape kexaone-236b-a23b-3l --format q4_k_m --vocab 153600 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape bloom-7b1 --format q4_k_m --vocab 250880 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape mpt-7b --format q4_k_m --vocab 50432 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape llama4-scout-17b-16e-4l --format q4_k_m --vocab 202048 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape glm45air-106b-a12b-6l --format q4_k_m --vocab 151552 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape qwen3next-80b-a3b-8l --format q4_k_m --vocab 151936 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape falcon-h1-0.5b --format q4_k_m --out /tmp/gguf
    python docs/bench/random_gguf.py --shape falcon-h1-7b --format q4_k_m --vocab 130049 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape mamba2-2.7b --format q4_k_m --vocab 50288 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape mamba2-codestral-7b --format q4_k_m --out /tmp/gguf
    python docs/bench/random_gguf.py --shape mamba-2.8b --format q4_k_m --vocab 50280 --out /tmp/gguf
    python docs/bench/random_gguf.py --shape falcon-mamba-7b --format q4_k_m --vocab 65024 --out /tmp/gguf

Formats: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1 (quantized by gguf-py from normal values), mxfp4
(gpt-oss's files as ggml-org publishes them: the experts in MXFP4, the other matrices in Q8_0), q4_k_m
(llama.cpp's recipe: Q4_K, with Q6_K for the output layer and for attn_v / ffn_down in the layers
llama.cpp gives more bits), q5_k_m (the same with Q5_K), q3_k_m (Q3_K, those layers' attn_v / ffn_down
in Q4_K), q2_k (Q2_K, those in Q3_K), iq4_nl and iq4_xs (llama.cpp's recipes without an importance matrix:
Q5_K for the first eighth of the ffn_down, and for attn_v where four or more query heads share a key head); rows that 256-value super-blocks do not divide (Qwen2.5-0.5B's
896) take llama.cpp's fallbacks, Q5_0 and Q8_0. The files hold no output layer but the Qwen2.5-7B's: the
token embeddings are tied to it, and so take the output layer's Q6_K in all four, as llama-quantize
gives a tied table (before 2026-12-04 they took the layers' type). The qwen2.5 shapes are written as
llama.cpp's converter writes a Qwen2 model: architecture "qwen2", biases on the queries, keys and
values, Qwen2's rope base and norm epsilon; the qwen3 ones as a Qwen3: no biases, each head's
queries and keys normalised (attn_q_norm, attn_k_norm), heads of 128 whatever the hidden size; the
gemma3 ones as a Gemma 3: those norms, 256-wide heads, the attention's and the MLP's outputs normalised
(post_attention_norm, post_ffw_norm), a 512-token sliding window (llama.cpp makes every sixth layer
global; the 4B's window 1024 tokens, its global layers' rope scaled linearly by 8, as Gemma 3 4B's);
the granitemoe one as a Granite 3.1 3B-A800M (Granite's layout and multipliers, 40 experts of 512 rows,
8 a token); the qwen2moe one as Qwen1.5-MoE-A2.7B (Qwen2's layout, 60 experts of 1408 rows, 4 a token, and a shared
expert of 5632 rows every token takes, weighted by the sigmoid of its own one-row router, ffn_gate_inp_shexp;
1408-wide rows take the K-quants' fallbacks as above); the ernie4_5moe one as ERNIE-4.5-21B-A3B
(architecture ernie4_5-moe: Llama's layout, a dense first layer, then 64 experts of 1536 rows, 6 a token,
chosen by probability plus a bias an expert, exp_probs_b, and a shared expert two experts wide; its table
tied); the lfm2 ones as LFM2's (architecture lfm2: ten of the sixteen layers short convolutions, shortconv.in_proj
giving B, C and x, shortconv.conv's three taps a channel in F32, shortconv.out_proj; no K/V heads listed for
them; the others attend with Qwen3's q/k norms; the final norm named token_embd_norm; its table tied; the
lfm2moe one as LFM2-8B-A1B: 18 of 24 layers convolutions, two dense leading layers, then 32 experts of 1792
rows, 4 a token, chosen by the sigmoid of their logits plus a bias each, exp_probs_b);
the qwen35 ones as Qwen3.5's (architecture qwen35: three layers in four gated delta-rule layers, attn_qkv
giving q, k and v, attn_gate z, ssm_beta and ssm_alpha a value a head, ssm_conv1d's four taps a channel in F32,
ssm_dt's bias, ssm_a (-exp(A_log), drawn in [-8, -0.5] so that states decay), ssm_norm, ssm_out; the fourth
attends with 256-wide heads whose query product also gives a gate a head, Qwen3's q/k norms, a rotary over a
quarter of each head; the norms after the attention named post_attention_norm; attn_qkv takes attn_v's extra
bits, as llama-quantize counts it; the 0.8B and 2B sixteen value heads a layer, the 4B and 9B 32 over sixteen
key heads; the 9B's output layer its own; the qwen35moe ones as Qwen3.5-35B-A3B's (architecture qwen35moe: the 2B's
layout with 32 value heads, every layer's MLP 256 experts of 512 rows, 8 a token, beside a shared expert of 512
rows weighted by its own one-row router; its output layer its own; the -10l one ten of its forty layers); the
qwen3next ones as Qwen3-Next-80B-A3B's (architecture qwen3next: the qwen35moe layout with beta and alpha one
ssm_ba of 64 rows, the rotary a plain one over a quarter of each head, 512 experts of 512 rows, 10 a token;
the -8l one eight of its 48 layers); the falcon-h1 ones as Falcon-H1-0.5B's and 7B's (architecture falcon-h1:
every layer's attention and Mamba2 mixer side by side over one norm, 24 Mamba2 heads of 64 (the 7B's 128) with
a state of 128 (256) and one group, no norm of their answers, its rotary's base 1e11; its output layer its own);
the mamba2 ones as state-spaces' mamba2-2.7b's and Mamba-Codestral-7B's (architecture mamba2: Mamba2 layers alone,
a norm and a mixer each, no heads listed, 80 Mamba2 heads of 64 with a state of 128 in one group (Codestral's 128
heads in eight groups), the gated norm's weights a row a group, a context of 2^20 as its converter writes; the
2.7b's table tied, Codestral's output layer its own); the mamba ones as state-spaces' mamba-2.8b's and TII's
Falcon-Mamba-7B's (architecture mamba: selective-scan layers alone, ssm_in giving x and z, ssm_conv1d's four taps a
channel in F32 with its bias, ssm_x giving a time step of 160 (256) and B and C of 16, ssm_dt widening the step to
a channel each, with its bias, ssm_a a decay rate a channel and state value, ssm_d, ssm_out; Falcon-Mamba's saying
ssm.dt_b_c_rms; the 2.8b's table tied, Falcon-Mamba's output layer its own);
the glm4 one as GLM-4-9B-0414's (architecture glm4: biases on q/k/v, two K/V heads of 128, the rotary over half of
each head, post_attention_norm and post_ffw_norm after the attention and the MLP (Gemma's names), gate and up
one ffn_up of 2 x 13696
rows; its output layer its own); the deepseek2 one as DeepSeek-V2-Lite's (architecture deepseek2: multi-head latent
attention, attn_q, attn_kv_a_mqa giving a 512-value latent and a 64-value rotary part, attn_kv_a_norm, attn_k_b and
attn_v_b a matrix a head as llama.cpp's converter splits kv_b (k_b's 128-wide rows take the fallbacks), 16 heads of
128 + 64 query values and 128 value ones, YaRN 40x over 4,096 tokens with its log multiplier; a dense first layer,
then 64 experts of 1408 rows, 6 a token, beside two shared ones, ffn_*_shexp); the glm47flash ones as GLM-4.7-Flash's
(the same layout with low-rank queries, attn_q_a of 768 rows, attn_q_a_norm, attn_q_b, 20 heads of 192 + 64 and 256;
64 experts of 1536 rows, 4 a token, chosen by their sigmoid plus a bias each, renormalised and scaled by 1.8, beside
one shared; dims as I recall its config; the -12l one twelve of its 47 layers; their output layers their own);
the granite4h ones as Granite 4.0 H's (architecture granitehybrid: four attention layers of 40 (of 32 for the
350M), the others Mamba2 layers: ssm_in giving z, x, B, C and a time step a head, ssm_conv1d's four taps a
channel and their bias in F32, ssm_dt's bias, ssm_a (-exp(A_log), drawn in [-8, -0.5]) and ssm_d a value a
head, ssm_norm a row a group, ssm_out; no K/V heads listed for them; attention without rotary
(rope.scaling.finetuned false), Granite's four multipliers; the tiny one's 64 experts of 512 rows, 6 a token,
beside a shared expert of 1024 rows; dims as I recall their configs); the qwen3vl ones as Qwen3-VL's text GGUFs
(architecture qwen3vl, qwen3vlmoe for the 30B-A3B: Qwen3's layout and the 30B-A3B's experts, the multimodal
rotary's sections 24/20/20 and three deepstack layers in the metadata, rope base 5e6; the 8B's and the
30B-A3B's output layers their own); the nemotronh ones as Nemotron-H's (architecture nemotron_h: single-purpose
layers, a norm each, then a Mamba2 mixer as Granite 4.0 H's, an attention without positions, or an MLP of ffn_up
and ffn_down (squared ReLU), told apart by K/V heads and MLP widths listed a layer at a time; the 4B's and 8B's 52
layers and Nemotron Nano 9B v2's 56 in their patterns as I recall them; their output layers their own); the
nemotron3 ones as Nemotron 3 Nano 30B-A3B's (architecture nemotron_h_moe: its 52 layers in NVIDIA's pattern, 23 of
them mixtures of 128 squared-ReLU experts of 1856 rows (ffn_up_exps, ffn_down_exps: no gate), 6 a token, chosen by
their sigmoid plus a bias each, renormalised and scaled by 2.5, beside one shared expert of 3712 rows; 64 Mamba2 heads
of 64 in 8 groups, 32 query heads and 2 K/V heads of 128; its hidden 2688 and experts' 1856 rows are not whole
256-value super-blocks, so its "Q4_K_M" is mostly llama.cpp's Q5_0 and Q8_0 fallbacks, as the published files are;
the -12l one its first twelve layers); the nemotron3-super ones as Nemotron 3 Super 120B-A12B's, as I recall its
config (88 layers of a 4096-wide model; 512 experts of 2688 rows, 22 a token, working in a 1024-wide latent space:
ffn_latent_down before them, ffn_latent_up after, moe_latent_size in the metadata; a shared expert of 5376 rows on
the hidden state; 128 Mamba2 heads of 64; the -6l one its first six layers in Nano's pattern, two of them
mixtures); the glm45air ones as GLM-4.5-Air's (architecture glm4moe: 96 query heads
and 8 K/V heads of 128, half of each rotated, biases on q/k/v, post_attention_norm before the MLP, a dense first
layer of 10944 rows, then 128 experts of 1408 rows, 8 a token, chosen by their sigmoid plus a bias each and
renormalised, beside one shared expert; the -6l one its first six of 46 layers); the phi2 one as Phi-2's (architecture
phi2: LayerNorms with biases, the attention and an MLP of gelu(up) beside each other on one norm's output, a bias
on every product and on its own output layer, 32 of each 80-wide head's dimensions rotated); the command one as
Command R7B's (architecture cohere2: LayerNorms without biases, the attention and the SwiGLU beside each other, a
4096-token window in three layers of four, the fourth global and unrotated, its logits times 0.25, its table tied);
the hunyuan one as Hunyuan-1.8B-Instruct's (architecture hunyuan-dense: each head's query and key normed after the
rotation, attn_q_norm and attn_k_norm, its NTK alpha of 1000 folded into the base; its table tied); the minitron
one as Minitron-4B's and Nemotron-Mini-4B-Instruct's (architecture nemotron: LayerNorms with biases, an MLP of
relu(up)^2 alone, half of each 128-wide head rotated, 24 query heads over 8 K/V heads); the hunyuanmoe ones as
Hunyuan-A13B's (architecture hunyuan-moe: the dense ones' attention, every layer's 64 experts of 3072 rows, 8 a token
by softmax, renormalised, beside a shared MLP as wide; its table tied); the dots1 ones as dots.llm1's (architecture
dots1: 32 heads of 128 with their own K/V, each head's q/k norms, a dense first layer of 10944 rows, then 128 experts
of 1408 rows, 6 a token, DeepSeek-V3's routing scaled by 2.5, beside two shared ones); the minimax ones as MiniMax-M2's
(architecture minimax-m2: 48 query heads over 8 K/V heads of 128, q/k norms across all heads, 64 of each head's
values rotated, 256 experts of 1536 rows, 8 a token, by sigmoid plus a bias each, renormalised); the -4l and -3l ones
their first layers; the pythia one as Pythia-1.4B's (architecture gptneox: q/k/v as one attn_qkv, LayerNorms and
biases everywhere, the MLP of gelu(up) beside the attention on a norm of its own, a quarter of each head rotated); the
falcon-7b one as Falcon-7B's (architecture falcon: 71 query heads of 64 over one K/V head, one attn_qkv, one norm for
the attention and the MLP beside each other, no biases; its 4544-wide rows not whole super-blocks: llama.cpp's
Q5_0 and Q8_0 fallbacks); the afmoe ones by transformers' AfmoeConfig defaults (architecture afmoe: 32 layers of 2048,
16 heads of 128 with their own K/V, each head's q/k norms, a gate a query value on the attention's output (attn_gate),
norms before and after the attention and the MLP, three 1024-token window layers in four; a dense first layer of 6144,
then 64 experts of 1408 rows, 6 a token, by sigmoid plus a bias each, renormalised, beside two shared ones), the -8l
one its first eight layers; the apertus one as Apertus-8B's (architecture apertus: 32 query heads over 8 K/V heads
of 128, each head's q/k norms, an MLP of xIELU(up) 21504 wide, its numbers a layer in the metadata); the starcoder
one as StarCoderBase-1B's (architecture starcoder: 16 query heads of 128 over one K/V head, q/k/v one attn_qkv,
LayerNorms and biases everywhere, learned positions for 8,192 tokens, its table tied); the chatglm one as
GLM-4-9B-Chat's (architecture chatglm: GLM-4's layers without its output norms); the stablelm2 one as StableLM 2
12B's (architecture stablelm: 32 query heads over 8 K/V heads of 160, LayerNorms with biases, the MLP beside the
attention without a norm of its own, a quarter of each head rotated, each head's q/k LayerNorm with weights of its
own, attn_q_norm [32, 160]); the dbrx ones as DBRX's (architecture dbrx: 48 query heads over 8 K/V heads of 128,
q/k/v one attn_qkv clamped at 8, LayerNorms without biases, the norm before the experts attn_output_norm, 16 experts of
10752 rows, 4 a token by softmax), the -2l one its first two of 40 layers; the kexaone ones as K-EXAONE-236B-A23B's
(architecture exaone-moe: 64 query heads over 8 K/V heads of 128, each head's q/k norms, three 128-token window
layers in four, those alone rotating; a dense first layer of 18432, then 128 experts of 2048 rows, 8 a token,
DeepSeek-V3's routing, beside a shared one), the -3l one its first three of 48 layers; the bloom one as
BLOOM-7b1's (architecture bloom: 30 layers of 4096, 32 heads of 128, ALiBi, its embeddings LayerNormed,
token_embd_norm, LayerNorms and biases everywhere, q/k/v one attn_qkv, an MLP of gelu(up) 16384 wide, its table
tied); the mpt one as MPT-7B's (architecture mpt: 32 layers of 4096, 32 heads, ALiBi of 8, LayerNorms and
products without biases, q/k/v one attn_qkv, its table tied); the llama4 ones as Llama 4 Scout's (architecture llama4:
40 query heads over 8 K/V heads of 128, no q/k norm tensors, 16 experts of 8192 rows, one a token by sigmoid, beside a
shared one as wide, every layer; llama.cpp's fixed chunks of 8192 in three layers of four, the fourth unrotated), the
-4l one its first four of 48 layers;
the qwen3moe one as a Qwen3-MoE (Qwen3's layout, 128 experts of 768 rows, 8 a token, each layer's
three expert products a stack of all 128 experts' matrices, its router in F32 as llama-quantize leaves it);
the ministral3 ones as Ministral 3's (architecture mistral3: Llama's layout, 128-wide heads, its yarn
from a 16,384-token original context to 262,144, its queries' temperature past it; the 3B's table tied);
the olmo3 one as an OLMo 3 (architecture olmo2: no norms before the attention or the MLP, their outputs'
norms, the q/k norms across all heads, three layers in four through a 4096-token window, its global
layers' yarn from an 8,192-token original context);
the gpt-oss one as gpt-oss-20b (architecture gpt-oss: biases on q/k/v and the attention's output, a sink
a head, every other layer through a 128-token window, yarn from a 4,096-token original context, 32 experts
of 2880 rows with biases, 4 a token, its router's bias);
the smollm3 one as a SmolLM3 (Llama's layout; llama.cpp leaves every fourth layer unrotated); the
granite3 one as a Granite 3 2B (Llama's layout and its four multipliers);
the exaone4 one as EXAONE-4.0-1.2B (architecture exaone4: OLMo's norms of the outputs alone, each head's
q/k norms, every layer global; its rope's llama3 factors left out); the gemma ones as Gemma 1's (architecture gemma: Llama's two norms a block, 256-wide heads, every layer
global; the 2B's one key head); the gemma2 one as a Gemma 2: 256-wide heads without their norms, the output norms, a 4096-token window
on every other layer, the attention's and the logits' soft caps (50 and 30). ``--vocab`` pads the vocabulary with reserved control tokens
up to a real model's (Llama 3's 128,256, Qwen2.5's 151,936): the table, and the output product over
it, at their real size.
K-quant blocks are random bytes with their float16 scales set so that weights stay near
the magnitudes of a trained model's; their speed is what is measured, not their answers. (Their
codes' random bytes lean each weight row one way: the 7B's gates come out near -400, so its MLPs
hand their down products zeros, which neither runtime skips; an activation left near 1e-36 there
rather than 0 ran into subnormal arithmetic, docs/benchmarks.md "Subnormal activations".) Tensors are
written one at a time: a 7B file needs little more memory than one tensor.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gguf  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402

from models.checkpoints.gguf import default_model_path  # noqa: E402
from models.checkpoints.gguf_file import GGUFFile  # noqa: E402

# hidden, intermediate, layers, heads, kv heads (SmolLM2's from its configs; "1b": Llama-3.2-1B's; "7b":
# Qwen2.5-7B's, with Llama's layout; "8b": Llama-3.1-8B's; the qwen, smollm3, granite and gemma ones from
# their configs, in their families' layouts; each with SmolLM2's 49,152-token vocabulary unless --vocab says)
SHAPES = {"135m": (576, 1536, 30, 9, 3), "360m": (960, 2560, 32, 15, 5), "1b": (2048, 8192, 16, 32, 8),
          "1.7b": (2048, 8192, 24, 32, 32), "7b": (3584, 18944, 28, 28, 4), "8b": (4096, 14336, 32, 32, 8),
          "qwen2.5-0.5b": (896, 4864, 24, 14, 2), "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
          "qwen2.5-7b": (3584, 18944, 28, 28, 4), "qwen3-0.6b": (1024, 3072, 28, 16, 8),
          "qwen3-1.7b": (2048, 6144, 28, 16, 8), "qwen3-8b": (4096, 12288, 36, 32, 8),
          "smollm3-3b": (2048, 11008, 36, 16, 4), "granite3-2b": (2048, 8192, 40, 32, 8),
          "exaone4-1.2b": (2048, 4096, 30, 32, 8), "gemma-2b": (2048, 16384, 18, 8, 1), "gemma-7b": (3072, 24576, 28, 16, 16),
          "gemma2-2b": (2304, 9216, 26, 8, 4), "gemma3-1b": (1152, 6912, 26, 4, 1),
          "gemma3-4b": (2560, 10240, 34, 8, 4), "qwen3moe-30b-a3b": (2048, 6144, 48, 32, 4),
          "granitemoe-3b-a800m": (1536, 512, 32, 24, 8), "ministral3-3b": (3072, 9216, 26, 32, 8),
          "ministral3-8b": (4096, 14336, 34, 32, 8), "olmo3-7b": (4096, 11008, 32, 32, 32),
          "gpt-oss-20b": (2880, 2880, 24, 64, 8), "qwen2moe-a2.7b": (2048, 5632, 24, 16, 16),
          "ernie4_5moe-21b-a3b": (2560, 12288, 28, 20, 4), "lfm2-350m": (1024, 4608, 16, 16, 8),
          "lfm2-1.2b": (2048, 8192, 16, 32, 8), "lfm2moe-8b-a1b": (2048, 7168, 24, 32, 8),
          "qwen35-0.8b": (1024, 3584, 24, 8, 2), "qwen35-2b": (2048, 6144, 24, 8, 2),
          "qwen35-4b": (2560, 9216, 32, 16, 4), "qwen35-9b": (4096, 12288, 32, 16, 4),
          # Qwen3.5-35B-A3B's, and ten of its forty layers (its shapes a layer, a file a 24 GiB machine holds
          # beside both servers)
          "qwen35moe-35b-a3b": (2048, 512, 40, 16, 2), "qwen35moe-35b-a3b-10l": (2048, 512, 10, 16, 2),
          # Qwen3-Next-80B-A3B's, and eight of its 48 layers
          "qwen3next-80b-a3b": (2048, 512, 48, 16, 2), "qwen3next-80b-a3b-8l": (2048, 512, 8, 16, 2),
          "granite4h-350m": (768, 2048, 32, 12, 4), "granite4h-1b": (1536, 4096, 40, 12, 4),
          "granite4h-micro": (2048, 8192, 40, 32, 8), "granite4h-tiny": (1536, 512, 40, 12, 4),
          "qwen3vl-2b": (2048, 6144, 28, 16, 8), "qwen3vl-4b": (2560, 9728, 36, 32, 8),
          "qwen3vl-8b": (4096, 12288, 36, 32, 8), "qwen3vlmoe-30b-a3b": (2048, 6144, 48, 32, 4),
          "nemotronh-4b": (3072, 12288, 52, 32, 8), "nemotronh-8b": (4096, 21504, 52, 32, 8),
          "nemotronh-nano-9b": (4480, 15680, 56, 40, 8), "glm4-9b": (4096, 13696, 40, 32, 2),
          # DeepSeek-V2-Lite's and GLM-4.7-Flash's (one K/V head: the latent), and twelve of the latter's 47 layers
          "deepseek2-16b": (2048, 10944, 27, 16, 1), "glm47flash-30b-a3b": (2048, 10240, 47, 20, 1),
          "glm47flash-30b-a3b-12l": (2048, 10240, 12, 20, 1),
          # Nemotron 3 Nano 30B-A3B's (its intermediate: an expert's width), and its first twelve layers
          "nemotron3-nano-30b-a3b": (2688, 1856, 52, 32, 2), "nemotron3-nano-30b-a3b-12l": (2688, 1856, 12, 32, 2),
          # Nemotron 3 Super 120B-A12B's, and its first six layers
          "nemotron3-super-120b-a12b": (4096, 2688, 88, 32, 2), "nemotron3-super-120b-a12b-6l": (4096, 2688, 6, 32, 2),
          # Falcon-H1-0.5B's and 7B's (their MLP widths from their parameter counts)
          "falcon-h1-0.5b": (1024, 2048, 36, 8, 2), "falcon-h1-7b": (3072, 12288, 44, 12, 2),
          # state-spaces' mamba2-2.7b's and Mistral's Mamba-Codestral-7B's (Mamba2 layers alone: no MLP, no heads)
          "mamba2-2.7b": (2560, 0, 64, 0, 0), "mamba2-codestral-7b": (4096, 0, 64, 0, 0),
          # state-spaces' mamba-2.8b's and TII's Falcon-Mamba-7B's (selective-scan layers alone)
          "mamba-2.8b": (2560, 0, 64, 0, 0), "falcon-mamba-7b": (4096, 0, 64, 0, 0),
          # Gemma 4's E2B, E4B and 31B, as I recall their configs (the 31B too large to serve beside llama-server
          # here: its first ten layers), each with Gemma's 262,144-token vocabulary (--vocab 262144)
          "gemma4-e2b": (1536, 6144, 35, 8, 1), "gemma4-e4b": (2560, 10240, 42, 8, 2),
          "gemma4-31b": (5376, 21504, 60, 32, 16), "gemma4-31b-10l": (5376, 21504, 10, 32, 16),
          # Gemma 3n's E2B and E4B, as I recall their configs (with its 262,400-token vocabulary: --vocab 262400)
          "gemma3n-e2b": (2048, 8192, 30, 8, 2), "gemma3n-e4b": (2048, 16384, 35, 8, 2),
          # Gemma 4 26B-A4B's (its intermediate: the dense MLP's beside the experts), and its first ten layers
          "gemma4-26b-a4b": (2816, 2112, 30, 16, 8), "gemma4-26b-a4b-10l": (2816, 2112, 10, 16, 8),
          # GLM-4.5-Air's, and its first six layers
          "glm45air-106b-a12b": (4096, 10944, 46, 96, 8), "glm45air-106b-a12b-6l": (4096, 10944, 6, 96, 8),
          # Microsoft's Phi-2 and Cohere's Command R7B (c4ai-command-r7b-12-2024), as I recall their configs
          "phi2-2.7b": (2560, 10240, 32, 32, 32), "command-r7b": (4096, 14336, 32, 32, 8),
          # Tencent's Hunyuan-1.8B-Instruct; NVIDIA's Minitron-4B (Nemotron-Mini-4B-Instruct's shape too)
          "hunyuan-1.8b": (2048, 6144, 32, 16, 4), "minitron-4b": (3072, 9216, 32, 24, 8),
          # Tencent's Hunyuan-A13B, rednote's dots.llm1 and MiniMax-M2, as I recall their configs, and their first
          # few layers
          "hunyuanmoe-a13b": (4096, 3072, 32, 32, 8), "hunyuanmoe-a13b-4l": (4096, 3072, 4, 32, 8),
          "dots1-142b-a14b": (4096, 10944, 62, 32, 32), "dots1-142b-a14b-4l": (4096, 10944, 4, 32, 32),
          "minimax-m2": (3072, 1536, 62, 48, 8), "minimax-m2-3l": (3072, 1536, 3, 48, 8),
          # EleutherAI's Pythia-1.4B (GPT-NeoX), TII's Falcon-7B
          "pythia-1.4b": (2048, 8192, 24, 16, 16), "falcon-7b": (4544, 18176, 32, 71, 1),
          # AFMoE (Arcee's Trinity) by transformers' AfmoeConfig defaults, and its first eight layers
          "afmoe-18b": (2048, 6144, 32, 16, 16), "afmoe-18b-8l": (2048, 6144, 8, 16, 16),
          # Swiss AI's Apertus-8B; BigCode's StarCoderBase-1B
          "apertus-8b": (4096, 21504, 32, 32, 8), "starcoder-1b": (2048, 8192, 24, 16, 1),
          # THUDM's GLM-4-9B-Chat (ChatGLM's layout) and Stability's StableLM 2 12B
          "chatglm-9b": (4096, 13696, 40, 32, 2), "stablelm2-12b": (5120, 13824, 40, 32, 8),
          # Databricks' DBRX and LG's K-EXAONE-236B-A23B, as I recall their configs, and their first few layers
          "dbrx-132b": (6144, 10752, 40, 48, 8), "dbrx-132b-2l": (6144, 10752, 2, 48, 8),
          "kexaone-236b-a23b": (6144, 18432, 48, 64, 8), "kexaone-236b-a23b-3l": (6144, 18432, 3, 64, 8),
          # BigScience's BLOOM-7b1 and MosaicML's MPT-7B (ALiBi)
          "bloom-7b1": (4096, 16384, 30, 32, 32), "mpt-7b": (4096, 16384, 32, 32, 32),
          # Meta's Llama 4 Scout (its dense MLPs' width, which it does not use: every layer routes), and its first four
          # layers (three in chunks, the fourth unrotated)
          "llama4-scout-17b-16e": (5120, 16384, 48, 40, 8), "llama4-scout-17b-16e-4l": (5120, 16384, 4, 40, 8),
          # a Cohere2-MoE of made-up sizes (Command A's mixture's not at hand): for checking Loom's reading of the
          # architecture against llama-server's, not for speed figures
          "cohere2moe-check-8l": (2048, 4096, 8, 16, 4),
          # a Jamba of made-up sizes (its published ones' 8-layer blocks, narrower: Jamba Mini's experts would be
          # 11 GB in four layers), for checking Loom's reading of the architecture against llama-server's
          "jamba-check-8l": (2048, 5632, 8, 16, 4),
          # openbmb's MiniCPM3-4B (DeepSeek's latent attention, a dense MLP, its rotary's longrope factors)
          "minicpm3-4b": (2560, 6400, 62, 40, 40)}
CONV_TAPS = 3  # LFM2's convolutions: this token and two before
UNTIED = {"phi2-2.7b", "qwen2.5-7b", "qwen3-8b", "qwen3moe-30b-a3b", "ministral3-8b", "olmo3-7b", "gpt-oss-20b",
          "qwen2moe-a2.7b", "qwen35-9b", "qwen3vl-8b", "qwen3vlmoe-30b-a3b", "nemotronh-4b", "nemotronh-8b",
          "qwen35moe-35b-a3b", "qwen35moe-35b-a3b-10l", "glm4-9b", "deepseek2-16b", "glm47flash-30b-a3b",
          "glm47flash-30b-a3b-12l", "nemotron3-nano-30b-a3b", "nemotron3-nano-30b-a3b-12l", "glm45air-106b-a12b",
          "nemotron3-super-120b-a12b", "nemotron3-super-120b-a12b-6l",
          "glm45air-106b-a12b-6l", "qwen3next-80b-a3b", "qwen3next-80b-a3b-8l", "falcon-h1-0.5b", "falcon-h1-7b",
          "nemotronh-nano-9b", "mamba2-codestral-7b", "falcon-mamba-7b", "minitron-4b", "pythia-1.4b", "afmoe-18b",
          "afmoe-18b-8l", "dots1-142b-a14b", "dots1-142b-a14b-4l", "minimax-m2", "minimax-m2-3l",
          "apertus-8b", "chatglm-9b", "stablelm2-12b", "dbrx-132b", "dbrx-132b-2l", "kexaone-236b-a23b",
          "kexaone-236b-a23b-3l", "llama4-scout-17b-16e", "llama4-scout-17b-16e-4l"}  # the shapes whose output layer
# is a tensor of its own


@dataclass(frozen=True)
class Layout:
    """How llama.cpp's converter writes a family: its architecture's name, its head size (None:
    hidden / heads), rope base, norm epsilon and context, and the tensors its layers hold besides
    Llama's: biases on q/k/v, each head's q/k norms, norms of the attention's and the MLP's outputs."""
    arch: str
    head: int | None = None
    rope_base: float = 100000.0
    eps: float = 1e-5
    context: int = 8192
    biases: bool = False
    head_norms: bool = False
    output_norms: bool = False
    window: int | None = None
    input_norms: bool = True  # norms before the attention and the MLP (OLMo has none: its outputs' norms only)
    norms_across_heads: bool = False  # the q/k norms over all heads at once (OLMo's), not a head's
    linear_rope: float | None = None  # a linear rope scaling's factor (Gemma 3's from 4B: its global layers')
    soft_caps: tuple[float, float] | None = None  # the attention scores' and the logits' soft caps (Gemma 2's)
    scales: tuple[float, float, float, float] | None = None  # Granite's: embeddings, residuals, attention, logits
    experts: tuple[int, int, int] | None = None  # a mixture's experts, those each token uses, an expert's width
    shared_expert: int | None = None  # the width of an expert every token takes (Qwen2-MoE's, gated by its own router)
    shared_gate: bool = False  # the shared expert weighted by a router of its own (Qwen2-MoE's ffn_gate_inp_shexp)
    dense_lead: int = 0  # leading layers with a dense MLP (ERNIE 4.5's first)
    selection_bias: bool = False  # a bias an expert to choose by (ERNIE 4.5's exp_probs_b)
    yarn: tuple[float, int, float | None] | None = None  # a yarn's factor, original context, log multiplier
    temperature: float | None = None  # the queries' temperature past the original context (Ministral 3's beta)
    sinks: bool = False  # gpt-oss's: a sink a head, a bias on the attention's output, the router's and experts' biases
    mlp_norm: str = "ffn_norm"  # the name of the norm before the MLP (gpt-oss's "post_attention_norm")
    attending: tuple[int, ...] | None = None  # LFM2's: the layers that attend, the others short convolutions
    delta: tuple[int, int, int] | None = None  # Qwen3.5's delta-rule layers: key heads, value heads, a head's width
    mamba: tuple[int, int, int, int] | None = None  # Granite 4 H's Mamba2 layers: heads, a head's width, state, groups
    # a vision-language model's text: its multimodal rotary's sections (a head's rotary pairs by time, height,
    # width) and the layers Qwen3-VL's deepstack adds image features to
    vision_sections: tuple[int, int, int, int] | None = None
    deepstack: int = 0
    # Nemotron-H's single-purpose layers, a letter each (M: Mamba2, *: attention, -: an MLP of up and down, E: a
    # mixture of experts of up and down, Nemotron 3's, as ``experts`` and ``shared_expert`` say), its Mamba2 layers'
    # sizes in ``mamba``
    pattern: str | None = None
    expert_latent: int = 0  # the width the experts work in (Nemotron 3 Super's moe_latent_size; 0: the hidden size)
    # LayerNorms for RMSNorms: "biased" (Phi-2's, StarCoder2's, StableLM's: a bias beside each weight), "unbiased"
    # (Cohere's); the MLP beside the attention (no ffn_norm: Phi-2's, Cohere's); an MLP of up and down alone
    # (gelu: Phi-2's, StarCoder2's; relu^2: Nemotron's); a bias on every product, the output layer's too (Phi-2's)
    layer_norm: str | None = None
    parallel: bool = False
    gelu_mlp: bool = False
    all_biases: bool = False
    logit_scale: float | None = None  # Cohere's logits' factor
    fused_qkv: bool = False  # the queries', keys' and values' rows one attn_qkv (GPT-NeoX's, Falcon's)
    attention_gate: bool = False  # a gate a query value on the attention's output, attn_gate (AFMoE's)
    xielu: bool = False  # an MLP of xIELU(up) alone, its numbers a layer in the metadata (Apertus's)
    positions: bool = False  # learned positions, a table of ``context`` rows (position_embd: StarCoder's, GPT-2's)
    head_layer_norms: bool = False  # each head's q/k LayerNorm, a weight a head (StableLM 2 12B's attn_q_norm)
    clamp_kqv: float | None = None  # the queries, keys and values clamped (DBRX's)
    embedding_norm: bool = False  # the embeddings LayerNormed, token_embd_norm (BLOOM's)
    alibi_max_bias: float | None = None  # ALiBi's maximum bias in the metadata (MPT's; BLOOM's fixed by llama.cpp)
    window_pattern: int | None = None  # every n-th layer global, the others through ``window`` (Command R7B's 4)
    # GLM-4's: its rotary over this share of a head, gate and up one ffn_up
    rotary_share: float = 1.0
    glm: bool = False
    # DeepSeek's latent attention: the queries' low rank (None: full-rank queries, V2-Lite's), the latent's, a head's
    # query and key values that do not rotate, those that do, its value
    latent: tuple[int | None, int, int, int, int] | None = None
    shared_experts: int = 0  # DeepSeek's experts every token takes, as one shared expert (ffn_*_shexp)
    sigmoid: tuple[float, bool] | None = None  # DeepSeek-V3's sigmoid scores: the chosen weights' scale, renormalised
    longrope: bool = False  # rope_factors_long and _short (MiniCPM3's; a factor a rotary pair, drawn in [1, 4])
    # Mamba's selective-scan layers: their inner width, state, time step's rank, whether the step, B and C are normed
    selective: tuple[int, int, int, bool] | None = None
    # Jamba's: the layers that attend (one every this many, from this one; the others Mamba's, ``selective``'s, their
    # time step, B and C normed by weights), and those that route to ``experts`` (likewise), the others' MLPs dense
    jamba: tuple[int, int, int, int] | None = None
    # Gemma 4's: its global layers' head size and K/V heads (None: the others'), whether their values are their keys,
    # the last layers reading earlier ones' K/V (their MLPs twice as wide where double_wide), the per-layer inputs'
    # width, and a global layer every this many
    gemma4: tuple[int, int | None, bool, int, bool, int, int] | None = None
    # Gemma 3n's: the per-layer inputs' width, Laurel's rank, the AltUp streams, the last layers reading earlier
    # ones' K/V (their own K/V products written all the same, as llama.cpp requires), a global layer every this many
    gemma3n: tuple[int, int, int, int, int] | None = None


# Nemotron-H's layers, as I recall the 4B's and 8B's hybrid_override_pattern and Nemotron Nano 9B v2's
NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_NANO_9B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
NEMOTRON_3_NANO = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # (NVIDIA's Megatron Bridge's)
NEMOTRON_3_SUPER = (NEMOTRON_3_NANO * 2)[:88]  # (Super's 88 layers in Nano's rhythm: its own pattern not at hand)

LAYOUTS = {"smollm3": Layout("smollm3", rope_base=5e6, eps=1e-6, context=65536),
           "granite3": Layout("granite", rope_base=1e7, eps=1e-5, context=131072, scales=(12.0, 0.22, 0.015625, 8.0)),
           "qwen2.5": Layout("qwen2", rope_base=1e6, eps=1e-6, context=32768, biases=True),
           "qwen3": Layout("qwen3", head=128, rope_base=1e6, eps=1e-6, context=32768, head_norms=True),
           "granitemoe": Layout("granitemoe", rope_base=1e7, eps=1e-6, context=131072,
                                scales=(12.0, 0.22, 0.015625, 6.0), experts=(40, 8, 512)),
           "qwen2moe": Layout("qwen2moe", rope_base=1e6, eps=1e-6, context=8192, biases=True, experts=(60, 4, 1408),
                              shared_expert=5632, shared_gate=True),
           "ernie4_5moe": Layout("ernie4_5-moe", rope_base=500000.0, eps=1e-5, context=131072, experts=(64, 6, 1536),
                                 shared_expert=3072, dense_lead=1, selection_bias=True),
           "lfm2": Layout("lfm2", rope_base=1e6, eps=1e-5, context=128000, head_norms=True,
                          attending=(2, 5, 8, 10, 12, 14)),
           "lfm2moe": Layout("lfm2moe", rope_base=1e6, eps=1e-5, context=128000, head_norms=True,
                             attending=(2, 6, 10, 14, 18, 21), experts=(32, 4, 1792), dense_lead=2,
                             selection_bias=True),
           "qwen3moe": Layout("qwen3moe", head=128, rope_base=1e6, eps=1e-6, context=32768, head_norms=True,
                              experts=(128, 8, 768)),
           "ministral3": Layout("mistral3", head=128, rope_base=1e6, eps=1e-5, context=262144,
                                yarn=(16.0, 16384, 1.0), temperature=0.1),
           "olmo3": Layout("olmo2", rope_base=500000.0, eps=1e-6, context=65536, head_norms=True, output_norms=True,
                           input_norms=False, norms_across_heads=True, window=4096, yarn=(8.0, 8192, None)),
           # (gpt-oss's shapes, by their names' first part)
           "gpt": Layout("gpt-oss", head=64, rope_base=150000.0, eps=1e-5, context=131072, biases=True, window=128,
                         yarn=(32.0, 4096, None), experts=(32, 4, 2880), sinks=True, mlp_norm="post_attention_norm"),
           "exaone4": Layout("exaone4", rope_base=1e6, eps=1e-5, context=65536, head_norms=True, output_norms=True,
                             input_norms=False),
           "qwen35": Layout("qwen35", head=256, rope_base=1e7, eps=1e-6, context=262144, head_norms=True,
                            mlp_norm="post_attention_norm", delta=(16, 16, 128)),
           # (its shapes by "falcon"; its converter folds its multipliers into the weights: random ones need none)
           "falcon": Layout("falcon-h1", head=64, rope_base=1e11, eps=1e-5, context=16384, mamba=(24, 64, 128, 1)),
           "granite4h": Layout("granitehybrid", eps=1e-5, context=1 << 20, scales=(12.0, 0.22, 0.0078125, 8.0),
                               attending=(5, 15, 25, 35), mamba=(48, 64, 128, 1)),
           "qwen3vl": Layout("qwen3vl", head=128, rope_base=5e6, eps=1e-6, context=262144, head_norms=True,
                             vision_sections=(24, 20, 20, 0), deepstack=3),
           "qwen3vlmoe": Layout("qwen3vlmoe", head=128, rope_base=5e6, eps=1e-6, context=262144, head_norms=True,
                                experts=(128, 8, 768), vision_sections=(24, 20, 20, 0), deepstack=3),
           "nemotronh": Layout("nemotron_h", head=128, eps=1e-5, context=8192, mamba=(128, 64, 128, 8),
                               pattern=NEMOTRON_H_8B),
           "nemotron3": Layout("nemotron_h_moe", head=128, eps=1e-5, context=262144, mamba=(64, 64, 128, 8),
                               pattern=NEMOTRON_3_NANO, experts=(128, 6, 1856), shared_expert=3712,
                               selection_bias=True, sigmoid=(2.5, True)),
           # (its heads listed as none; a head's width only Mamba2's)
           "mamba2": Layout("mamba2", head=64, eps=1e-5, context=1 << 20, mamba=(80, 64, 128, 1), pattern="M" * 64),
           "glm45air": Layout("glm4moe", head=128, rope_base=1e6, eps=1e-5, context=131072, biases=True,
                              experts=(128, 8, 1408), shared_experts=1, dense_lead=1, selection_bias=True,
                              sigmoid=(1.0, True), rotary_share=0.5, mlp_norm="post_attention_norm"),
           "phi2": Layout("phi2", rope_base=10000.0, eps=1e-5, context=2048, biases=True, layer_norm="biased",
                          parallel=True, gelu_mlp=True, all_biases=True, rotary_share=0.4),
           "command": Layout("cohere2", head=128, rope_base=50000.0, eps=1e-5, context=131072, layer_norm="unbiased",
                             parallel=True, window=4096, window_pattern=4, logit_scale=0.25),
           # (its base: 10,000 x alpha 1000 ^ (128 / 126), as its converter folds it)
           "hunyuan": Layout("hunyuan-dense", head=128, rope_base=10000.0 * 1000.0 ** (128 / 126), eps=1e-5,
                             context=262144, head_norms=True),
           # (Nemotron-4's: its norms' weights as 1 + the checkpoint's, a random file's alike)
           "minitron": Layout("nemotron", head=128, rope_base=10000.0, eps=1e-5, context=4096, layer_norm="biased",
                              gelu_mlp=True, rotary_share=0.5),
           # (the dense one's attention; 64 experts of 3072 rows, 8 a token by softmax, beside a shared MLP as wide)
           "hunyuanmoe": Layout("hunyuan-moe", head=128, rope_base=10000.0 * 1000.0 ** (128 / 126), eps=1e-5,
                                context=262144, head_norms=True, experts=(64, 8, 3072), shared_expert=3072),
           # (each head's q/k norms; a dense first layer, then 128 experts of 1408 rows, 6 a token, DeepSeek-V3's
           # routing, beside two shared ones)
           "dots1": Layout("dots1", head=128, rope_base=1e7, eps=1e-5, context=32768, head_norms=True,
                           experts=(128, 6, 1408), shared_experts=2, dense_lead=1, selection_bias=True,
                           sigmoid=(2.5, True)),
           # (q/k norms across all heads, 64 of each head's 128 values rotated; 256 experts of 1536 rows, 8 a token,
           # by sigmoid and bias, renormalised)
           "minimax": Layout("minimax-m2", head=128, rope_base=5e6, eps=1e-6, context=196608, head_norms=True,
                             norms_across_heads=True, rotary_share=0.5, experts=(256, 8, 1536), selection_bias=True),
           # (GPT-NeoX's: the MLP beside the attention on a norm of its own, use_parallel_residual)
           "pythia": Layout("gptneox", rope_base=10000.0, eps=1e-5, context=2048, biases=True, layer_norm="biased",
                            gelu_mlp=True, all_biases=True, rotary_share=0.25, fused_qkv=True),
           # (AFMoE's: each head's q/k norms, a gate on the attention's output, norms before and after the attention
           # and the MLP, three window layers in four; a dense first layer, then experts by sigmoid and bias,
           # renormalised and scaled, beside two shared ones)
           "afmoe": Layout("afmoe", head=128, rope_base=10000.0, eps=1e-5, context=16384, head_norms=True,
                           output_norms=True, attention_gate=True, window=1024, window_pattern=4,
                           experts=(64, 6, 1408), shared_experts=2, dense_lead=1, selection_bias=True,
                           sigmoid=(1.0, True)),
           # (Apertus's: each head's q/k norms, an MLP of xIELU(up), its numbers as a trained model's, near 0.8 and 0.5)
           "apertus": Layout("apertus", head=128, rope_base=12000000.0, eps=1e-5, context=65536, head_norms=True,
                             gelu_mlp=True, xielu=True),
           # (StarCoder's: GPT-2's layers with one K/V head, q/k/v one attn_qkv, LayerNorms and biases everywhere,
           # learned positions, no rotary)
           "starcoder": Layout("starcoder", head=128, eps=1e-5, context=8192, biases=True, layer_norm="biased",
                               gelu_mlp=True, all_biases=True, fused_qkv=True, positions=True),
           "glm4": Layout("glm4", head=128, rope_base=10000.0, eps=1e-5, context=32768, biases=True, output_norms=True,
                          rotary_share=0.5, glm=True),
           # (GLM-4's without its output norms)
           "chatglm": Layout("chatglm", head=128, rope_base=10000.0, eps=1.5625e-07, context=131072, biases=True,
                             rotary_share=0.5, glm=True),
           # (StableLM 2 12B's: LayerNorms, the MLP beside the attention, a quarter of each head rotated, each head's
           # q/k LayerNorm with weights of its own)
           "stablelm2": Layout("stablelm", rope_base=10000.0, eps=1e-5, context=4096, layer_norm="biased",
                               parallel=True, rotary_share=0.25, head_layer_norms=True),
           # (DBRX's: LayerNorms without biases, q/k/v one product clamped at 8, 16 experts, 4 a token by softmax)
           # (BLOOM's: ALiBi, its embeddings LayerNormed, LayerNorms and biases everywhere, q/k/v one attn_qkv, an MLP
           # of gelu(up); MPT's: ALiBi, LayerNorms without biases, no biases at all)
           "bloom": Layout("bloom", eps=1e-5, context=2048, biases=True, layer_norm="biased", gelu_mlp=True,
                           all_biases=True, fused_qkv=True, embedding_norm=True),
           "mpt": Layout("mpt", eps=1e-5, context=2048, layer_norm="unbiased", gelu_mlp=True, fused_qkv=True,
                         alibi_max_bias=8.0),
           "dbrx": Layout("dbrx", head=128, rope_base=500000.0, eps=1e-5, context=32768, layer_norm="unbiased",
                          fused_qkv=True, experts=(16, 4, 10752), mlp_norm="attn_output_norm", clamp_kqv=8.0),
           # (K-EXAONE's: each head's q/k norms, three window layers of 128 tokens in four, those alone rotating; a
           # dense first layer, then 128 experts of 2048 rows, 8 a token, DeepSeek-V3's routing, beside a shared one)
           "kexaone": Layout("exaone-moe", head=128, rope_base=1e6, eps=1e-5, context=262144, head_norms=True,
                             window=128, window_pattern=4, experts=(128, 8, 2048), shared_experts=1, dense_lead=1,
                             selection_bias=True, sigmoid=(2.5, True)),
           # (Llama 4's: 16 experts of 8192 rows, one a token by sigmoid, beside a shared one as wide; no q/k norm
           # tensors, its chunks and unrotated layers llama.cpp's fixed pattern)
           "llama4": Layout("llama4", head=128, rope_base=500000.0, eps=1e-5, context=10485760, experts=(16, 1, 8192),
                            shared_experts=1),
           # (Cohere2-MoE's: Command R7B's layers with RMSNorms, its window layers a flag a layer (three in four, as
           # its converter lists them), a dense first layer, then 32 experts of 512 rows, 4 a token by sigmoid, averaged
           # with a shared one)
           "cohere2moe": Layout("cohere2moe", head=128, rope_base=50000.0, eps=1e-5, context=131072, parallel=True,
                                window=4096, logit_scale=0.25, experts=(32, 4, 512), shared_experts=1, dense_lead=1),
           # (DeepSeek-V2-Lite's YaRN: a factor of 40 over 4,096 tokens, mscale_all_dim 0.707)
           "deepseek2": Layout("deepseek2", rope_base=10000.0, eps=1e-6, context=163840, experts=(64, 6, 1408),
                               dense_lead=1, shared_experts=2, yarn=(40.0, 4096, 0.0707), latent=(None, 512, 128, 64, 128)),
           # (its file: DeepSeek's tensors with kv_b whole, longrope's short and long factors over 32,768 tokens)
           "minicpm3": Layout("minicpm3", rope_base=10000.0, eps=1e-5, context=32768,
                              latent=(768, 256, 64, 32, 64), longrope=True),
           "glm47flash": Layout("deepseek2", rope_base=1e6, eps=1e-5, context=202752, experts=(64, 4, 1536),
                                dense_lead=1, shared_experts=1, selection_bias=True, sigmoid=(1.8, True),
                                latent=(768, 512, 192, 64, 256)),
           "gemma": Layout("gemma", head=256, rope_base=10000.0, eps=1e-6, context=8192),
           "gemma2": Layout("gemma2", head=256, rope_base=10000.0, eps=1e-6, context=8192, output_norms=True,
                            window=4096, soft_caps=(50.0, 30.0)),
           "gemma3": Layout("gemma3", head=256, rope_base=1e6, eps=1e-6, context=32768, head_norms=True,
                            output_norms=True, window=512)}


LAYOUTS["gemma4"] = Layout("gemma4", head=256, rope_base=1e6, eps=1e-6, context=131072, head_norms=True,
                           output_norms=True, window=512, soft_caps=(0.0, 30.0), gemma4=(512, None, False, 20, True, 256, 5))
LAYOUTS["gemma3n"] = Layout("gemma3n", head=256, rope_base=1e6, eps=1e-6, context=32768, head_norms=True,
                            output_norms=True, window=512, soft_caps=(0.0, 30.0), gemma3n=(256, 64, 4, 10, 5))
# shapes whose layout is not their family's: Gemma 3 4B's window of 1024 and global rope scaled 8 times
SHAPE_LAYOUTS = {"gemma3-4b": replace(LAYOUTS["gemma3"], window=1024, linear_rope=8.0),
                 **{shape: replace(LAYOUTS["qwen35"], delta=(16, 32, 128)) for shape in ("qwen35-4b", "qwen35-9b")},
                 **{shape: replace(LAYOUTS["qwen35"], arch="qwen35moe", delta=(16, 32, 128), experts=(256, 8, 512),
                                   shared_expert=512, shared_gate=True)
                    for shape in ("qwen35moe-35b-a3b", "qwen35moe-35b-a3b-10l")},
                 **{shape: replace(LAYOUTS["qwen35"], arch="qwen3next", delta=(16, 32, 128), experts=(512, 10, 512),
                                   shared_expert=512, shared_gate=True)
                    for shape in ("qwen3next-80b-a3b", "qwen3next-80b-a3b-8l")},
                 "falcon-h1-7b": replace(LAYOUTS["falcon"], head=128, mamba=(24, 128, 256, 1)),
                 "mamba2-codestral-7b": replace(LAYOUTS["mamba2"], mamba=(128, 64, 128, 8)),
                 "mamba-2.8b": Layout("mamba", head=64, eps=1e-5, context=1 << 20, selective=(5120, 16, 160, False)),
                 "falcon-mamba-7b": Layout("mamba", head=64, eps=1e-5, context=1 << 20, selective=(8192, 16, 256, True)),
                 # (Jamba Mini's periods: an attention layer in eight from the fifth, experts every other layer)
                 "jamba-check-8l": Layout("jamba", eps=1e-6, context=262144, selective=(4096, 16, 128, False),
                                          experts=(8, 2, 5632), jamba=(8, 4, 2, 1)),
                 "gemma3n-e4b": replace(LAYOUTS["gemma3n"], gemma3n=(256, 64, 4, 15, 5)),
                 "gemma4-e4b": replace(LAYOUTS["gemma4"], gemma4=(512, None, False, 18, False, 256, 6)),
                 **{shape: replace(LAYOUTS["gemma4"], window=1024, gemma4=(512, 4, True, 0, False, 0, 6))
                    for shape in ("gemma4-31b", "gemma4-31b-10l")},
                 **{shape: replace(LAYOUTS["gemma4"], window=1024, gemma4=(512, 2, True, 0, False, 0, 6),
                                   experts=(128, 8, 704))
                    for shape in ("gemma4-26b-a4b", "gemma4-26b-a4b-10l")},
                 # (Falcon 7B's: one norm for the attention and the MLP beside each other, one K/V head, no biases)
                 "falcon-7b": Layout("falcon", head=64, rope_base=10000.0, eps=1e-5, context=2048, layer_norm="biased",
                                     parallel=True, gelu_mlp=True, fused_qkv=True),
                 "granite4h-350m": replace(LAYOUTS["granite4h"], attending=(3, 11, 19, 27), mamba=(48, 32, 128, 1)),
                 "granite4h-micro": replace(LAYOUTS["granite4h"], mamba=(64, 64, 128, 1)),
                 "granite4h-tiny": replace(LAYOUTS["granite4h"], experts=(64, 6, 512), shared_expert=1024),
                 **{shape: replace(LAYOUTS["nemotron3"], mamba=(128, 64, 128, 8), experts=(512, 22, 2688),
                                   shared_expert=5376, expert_latent=1024, pattern=NEMOTRON_3_SUPER)
                    for shape in ("nemotron3-super-120b-a12b", "nemotron3-super-120b-a12b-6l")},
                 "nemotronh-4b": replace(LAYOUTS["nemotronh"], mamba=(112, 64, 128, 8)),
                 "nemotronh-nano-9b": replace(LAYOUTS["nemotronh"], mamba=(128, 80, 128, 8), context=131072,
                                              pattern=NEMOTRON_NANO_9B)}
QWEN35_ATTENTION_EVERY, QWEN35_CONV_TAPS = 4, 4


def layout(shape: str) -> Layout:
    """A shape's family layout, by its name's prefix (Llama's for the unprefixed ones)."""
    return SHAPE_LAYOUTS.get(shape) or LAYOUTS.get(shape.split("-")[0], Layout("llama"))
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q8_0": 7, "q2_k": 10,
              "q3_k_m": 12, "q4_k_m": 15, "q5_k_m": 17, "iq4_nl": 25, "iq4_xs": 30, "mxfp4": 38}
FLOAT_FORMATS = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1,
                 "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}  # one type for every matrix
# the K-quant recipes: the layers' type, and the type of the tensors llama.cpp gives more bits
K_RECIPES = {"q2_k": (Q.Q2_K, Q.Q3_K), "q3_k_m": (Q.Q3_K, Q.Q4_K), "q4_k_m": (Q.Q4_K, Q.Q6_K),
             "q5_k_m": (Q.Q5_K, Q.Q6_K)}
# the IQ4 recipes (llama.cpp's without an importance matrix): the layers' type, Q5_K for the first eighth
# of the layers' ffn_down and (where four or more query heads share a key head) every attn_v
IQ4_RECIPES = {"iq4_nl": Q.IQ4_NL, "iq4_xs": Q.IQ4_XS}
# llama.cpp's fallbacks for rows that 256-value super-blocks do not divide, in those recipes
IQ4_FALLBACKS = {Q.IQ4_XS: Q.IQ4_NL, Q.IQ4_NL: Q.IQ4_NL, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
# where each K-quant block keeps its float16 scale (d) and, where it has one, its minimums' scale (dmin)
HALF_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,),
               Q.IQ4_XS: (0,)}
# MXFP4's exponent bytes (E8M0, a block's scale 2^(e - 127)): values of up to 6 x 2^-7, as HALF_RANGE's
EXPONENTS = {Q.MXFP4: (118, 122)}
HALF_RANGE = {Q.Q2_K: (1.5e-3, 3e-3), Q.Q3_K: (5e-4, 1e-3), Q.Q4_K: (2e-4, 6e-4), Q.Q5_K: (1e-4, 3e-4),
              Q.Q6_K: (1e-4, 3e-4), Q.IQ4_NL: (5e-4, 1e-3),
              Q.IQ4_XS: (3e-5, 6e-5)}  # weights of about +-0.1, as a trained model's


def tensor_type(name: str, layer: int, layers: int, fmt: str, width: int, tied: bool, shared_heads: int) -> Q:
    if name.endswith(("norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
                      "attn_sinks.weight", "shortconv.conv.weight", "ssm_conv1d.weight", ".ssm_a", ".ssm_d",
                      ".ffn_norm", "rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight",
                      "layer_output_scale.weight", ".scale", "_norm_1.weight",
                      "_norm_2.weight", "altup_correct_scale.weight")):
        # (nor any router, nor a convolution's taps, nor the recurrent layers' decay rates and skips; Falcon-H1's
        # MLP norm has no kind in its name)
        return Q.F32
    if any(part in name for part in ("altup", "laurel", "per_layer_model_proj")):  # (llama-quantize leaves them: the
        return Q.F16                                                                   # converter's F16)
    if fmt == "mxfp4":
        return Q.MXFP4 if "_exps." in name else Q.Q8_0
    name = name.replace("_exps.", ".").replace("_shexp.", ".")  # an expert's type is its dense product's
    if fmt in FLOAT_FORMATS:
        return FLOAT_FORMATS[fmt]
    output = name == "output.weight" or (tied and name == "token_embd.weight")  # (a tied table is the output)
    if fmt in IQ4_RECIPES:
        kind = name.split(".")[-2]
        if output:
            kind = Q.Q6_K
        elif (kind == "ffn_down" and layer < layers // 8) or (kind == "attn_v" and shared_heads >= 4):
            kind = Q.Q5_K
        else:
            kind = IQ4_RECIPES[fmt]
        return IQ4_FALLBACKS[kind] if width % 256 else kind
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    wide = more_bits and name.split(".")[-2] in ("attn_v", "attn_qkv", "ffn_down")  # (attn_qkv: llama-quantize's)
    if width % 256:  # rows a K-quant's 256-value super-blocks do not divide: llama.cpp's fallbacks
        return Q.Q8_0 if wide or output else Q.Q5_0
    base, more = K_RECIPES[fmt]
    return Q.Q6_K if output else more if wide else base


def tensor_data(kind: Q, shape: tuple[int, ...], rng: np.random.Generator, bias: bool = False,
                decays: bool = False, time_steps: bool = False, scale: float = 1.0) -> np.ndarray:
    """Random values of ``kind`` (``scale`` times the usual weights' size); ``decays``: -exp(A_log) rates that
    decay; ``time_steps``: a time step's bias as Mamba initialises it, softplus^-1 of steps in [0.001, 0.1]."""
    rows, width = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) >= 2 else (1, shape[0])
    if kind in EXPONENTS:  # random codes, the first byte of each block its exponent
        block, block_bytes = GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows, width // block, block_bytes), dtype=np.uint8)
        data[..., 0] = rng.integers(*EXPONENTS[kind], (rows, width // block), dtype=np.uint8)
        return data.reshape(rows, -1)
    if kind in HALF_FIELDS:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows, width // block, block_bytes), dtype=np.uint8)
        for at in HALF_FIELDS[kind]:
            low, high = HALF_RANGE[kind]
            scales = rng.uniform(low * scale, high * scale, (rows, width // block)).astype(np.float16)
            data[..., at:at + 2] = scales.view(np.uint8).reshape(rows, width // block, 2)
        return data.reshape(rows, -1)
    values = (rng.standard_normal((rows, width), dtype=np.float32) * 0.05 * scale).reshape(shape)
    if time_steps:
        steps = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
        return np.log(np.expm1(steps)).astype(np.float32)
    if decays:  # Qwen3.5's -exp(A_log): a state that decays
        return -rng.uniform(0.5, 8.0, shape).astype(np.float32)
    if kind == Q.F32:  # a norm's weights are ones; a bias, small values
        return values if len(shape) >= 2 else values * 0.1 if bias else np.ones(shape, np.float32)
    if kind == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, kind)  # (BF16's too: its bytes)


def mamba2_tensors(hidden: int, mamba: tuple[int, int, int, int]):
    """A Mamba2 mixer's tensors as llama.cpp's converter writes them (after the layer's norm)."""
    ssm_heads, width, state, groups = mamba
    conv = ssm_heads * width + 2 * groups * state
    return (("ssm_in.weight", (ssm_heads * width + conv + ssm_heads, hidden)),
            ("ssm_conv1d.weight", (conv, QWEN35_CONV_TAPS)), ("ssm_conv1d.bias", (conv,)),
            ("ssm_dt.bias", (ssm_heads,)), ("ssm_a", (ssm_heads, 1)), ("ssm_d", (ssm_heads, 1)),
            ("ssm_norm.weight", (groups, ssm_heads * width // groups)), ("ssm_out.weight", (hidden, ssm_heads * width)))


def single_purpose_layer(letter: str, hidden: int, inner: int, q: int, kv: int, family: Layout):
    """A Nemotron-H layer's tensors: its norm, then its Mamba2 mixer's (M), attention's (*), MLP's (-) or
    experts' (E: the router and selection bias, the experts' up and down stacks, the shared expert's)."""
    if letter == "E":
        count, _, width = family.experts
        space = family.expert_latent or hidden  # (the experts' rows: a latent mixture's narrower)
        latent = (("ffn_latent_down.weight", (space, hidden)), ("ffn_latent_up.weight", (hidden, space))) \
            if family.expert_latent else ()
        parts = (("ffn_gate_inp.weight", (count, hidden)), ("exp_probs_b.bias", (count,)), *latent,
                 ("ffn_up_exps.weight", (count, width, space)), ("ffn_down_exps.weight", (count, space, width)),
                 ("ffn_up_shexp.weight", (family.shared_expert, hidden)),
                 ("ffn_down_shexp.weight", (hidden, family.shared_expert)))
    else:
        parts = {"M": mamba2_tensors(hidden, family.mamba),
                 "*": (("attn_q.weight", (q, hidden)), ("attn_k.weight", (kv, hidden)),
                       ("attn_v.weight", (kv, hidden)), ("attn_output.weight", (hidden, q))),
                 "-": (("ffn_up.weight", (inner, hidden)), ("ffn_down.weight", (hidden, inner)))}[letter]
    return (("attn_norm.weight", (hidden,)), *parts)


def latent_attention(hidden: int, heads: int, latent: tuple[int | None, int, int, int, int], whole: bool = False):
    """DeepSeek's latent attention's tensors as llama.cpp's converter writes them (kv_b_proj split into k_b, each
    head's key rows transposed, and v_b; ``whole``: kv_b as it is, MiniCPM3's), by name without their kind."""
    q_rank, kv_rank, nope, rotary, value = latent
    queries = (("attn_q", (heads * (nope + rotary), hidden)),) if q_rank is None else (
        ("attn_q_a", (q_rank, hidden)), ("attn_q_a_norm", (q_rank,)), ("attn_q_b", (heads * (nope + rotary), q_rank)))
    up = (("attn_kv_b", (heads * (nope + value), kv_rank)),) if whole else (
        ("attn_k_b", (heads, kv_rank, nope)), ("attn_v_b", (heads, value, kv_rank)))
    return (*queries, ("attn_kv_a_mqa", (kv_rank + rotary, hidden)), ("attn_kv_a_norm", (kv_rank,)), *up,
            ("attn_output", (hidden, heads * value)))


def gemma4_layer_kinds(layers: int, gemma4: tuple) -> list[bool]:
    """Whether each of Gemma 4's layers is a global one (every n-th, the last always)."""
    every = gemma4[-1]
    return [(i + 1) % every == 0 or i == layers - 1 for i in range(layers)]


def gemma4_tensors(hidden: int, inner: int, layers: int, heads: int, kv_heads: int, head: int, vocab: int,
                   gemma4: tuple, experts: tuple[int, int, int] | None = None):
    """Gemma 4's tensors after its token table, as llama.cpp's converter writes them: the per-layer inputs' table,
    projection and norm, rope_freqs (the global layers'), then each layer's (no K/V products where it reads an
    earlier layer's, no values where a global layer's are its keys; ``experts`` beside its MLP: their router and
    its scale, their gate and up as one stack, their down stack and scales, their norms), the final norm."""
    global_head, global_kv, values_are_keys, shared, double_wide, width, _ = gemma4
    if width:
        yield "per_layer_token_embd.weight", -1, (vocab, layers * width)
        yield "per_layer_model_proj.weight", -1, (layers * width, hidden)
        yield "per_layer_proj_norm.weight", -1, (width,)
    yield "rope_freqs.weight", -1, (global_head // 2,)
    for i, is_global in enumerate(gemma4_layer_kinds(layers, gemma4)):
        dim, kv = (global_head, global_kv or kv_heads) if is_global else (head, kv_heads)
        reads = i >= layers - shared
        mlp = inner * (2 if double_wide and reads else 1)
        names = [("attn_norm", (hidden,)), ("attn_q", (heads * dim, hidden)), ("attn_q_norm", (dim,))]
        if not reads:
            names += [("attn_k", (kv * dim, hidden)), ("attn_k_norm", (dim,))]
            names += [] if values_are_keys and is_global else [("attn_v", (kv * dim, hidden))]
        names += [("attn_output", (hidden, heads * dim)), ("post_attention_norm", (hidden,)), ("ffn_norm", (hidden,)),
                  ("ffn_gate", (mlp, hidden)), ("ffn_up", (mlp, hidden)), ("ffn_down", (hidden, mlp)),
                  ("post_ffw_norm", (hidden,)), ("layer_output_scale", (1,))]
        if width:
            names += [("inp_gate", (width, hidden)), ("proj", (hidden, width)), ("post_norm", (hidden,))]
        if experts:
            count, _, each = experts
            names += [("ffn_gate_inp", (count, hidden)), ("ffn_gate_inp.scale", (hidden,)),
                      ("ffn_gate_up_exps", (count, 2 * each, hidden)), ("ffn_down_exps", (count, hidden, each)),
                      ("ffn_down_exps.scale", (count,)), ("pre_ffw_norm_2", (hidden,)), ("post_ffw_norm_1", (hidden,)),
                      ("post_ffw_norm_2", (hidden,))]
        yield from ((f"blk.{i}.{name}" + ("" if name.endswith(".scale") else ".weight"), i, shape)
                    for name, shape in names)
    yield "output_norm.weight", -1, (hidden,)


def gemma3n_tensors(hidden: int, inner: int, layers: int, heads: int, kv_heads: int, head: int, vocab: int,
                    gemma3n: tuple):
    """Gemma 3n's tensors after its token table, as llama.cpp's converter writes them: the per-layer inputs' table,
    projection and norm, the AltUp projections (a stack each), then each layer's, the final norm."""
    width, rank, streams, _, _ = gemma3n
    yield "per_layer_token_embd.weight", -1, (vocab, layers * width)
    yield "per_layer_model_proj.weight", -1, (layers * width, hidden)
    yield "per_layer_proj_norm.weight", -1, (width,)
    yield "altup_proj.weight", -1, (streams - 1, hidden, hidden)
    yield "altup_unembd_proj.weight", -1, (streams - 1, hidden, hidden)
    for i in range(layers):
        names = [("attn_norm", (hidden,)), ("attn_q", (heads * head, hidden)), ("attn_k", (kv_heads * head, hidden)),
                 ("attn_v", (kv_heads * head, hidden)), ("attn_q_norm", (head,)), ("attn_k_norm", (head,)),
                 ("attn_output", (hidden, heads * head)), ("post_attention_norm", (hidden,)), ("ffn_norm", (hidden,)),
                 ("ffn_gate", (inner, hidden)), ("ffn_up", (inner, hidden)), ("ffn_down", (hidden, inner)),
                 ("post_ffw_norm", (hidden,)), ("inp_gate", (width, hidden)), ("proj", (hidden, width)),
                 ("post_norm", (hidden,)), ("altup_correct_coef", (streams, streams)),
                 ("altup_correct_scale", (hidden,)), ("altup_predict_coef", (streams * streams, streams)),
                 ("altup_router", (streams, hidden)), ("altup_router_norm", (hidden,)), ("laurel_l", (rank, hidden)),
                 ("laurel_r", (hidden, rank)), ("laurel_post_norm", (hidden,))]
        yield from ((f"blk.{i}.{name}.weight", i, shape) for name, shape in names)
    yield "output_norm.weight", -1, (hidden,)


def tensors(hidden: int, inner: int, layers: int, heads: int, kv_heads: int, head: int, vocab: int, family: Layout,
            tied: bool):
    q, kv = head * heads, head * kv_heads
    dense = (("ffn_up", (2 * inner, hidden)), ("ffn_down", (hidden, inner))) if family.glm else (
        ("ffn_up", (inner, hidden)), ("ffn_down", (hidden, inner))) if family.gelu_mlp else (
        ("ffn_gate", (inner, hidden)), ("ffn_up", (inner, hidden)), ("ffn_down", (hidden, inner)))
    mlp = dense
    if family.experts:  # the router, then every expert's matrices of a product as one stack
        count, _, width = family.experts
        mlp = (("ffn_gate_inp", (count, hidden)), ("ffn_gate_exps", (count, width, hidden)),
               ("ffn_up_exps", (count, width, hidden)), ("ffn_down_exps", (count, hidden, width)))
        if family.selection_bias:
            mlp += (("exp_probs_b", (count,)),)
    if family.shared_expert or family.shared_experts:  # its router's one row, then its products
        width = family.shared_expert or family.shared_experts * family.experts[2]
        mlp += ((("ffn_gate_inp_shexp", (hidden,)),) if family.shared_gate else ()) + (
            ("ffn_gate_shexp", (width, hidden)), ("ffn_up_shexp", (width, hidden)), ("ffn_down_shexp", (hidden, width)))
    yield "token_embd.weight", -1, (vocab, hidden)
    if family.embedding_norm:
        yield "token_embd_norm.weight", -1, (hidden,)
        yield "token_embd_norm.bias", -1, (hidden,)
    if family.positions:
        yield "position_embd.weight", -1, (family.context, hidden)
    if family.gemma3n:
        yield from gemma3n_tensors(hidden, inner, layers, heads, kv_heads, head, vocab, family.gemma3n)
        return
    if family.gemma4:
        yield from gemma4_tensors(hidden, inner, layers, heads, kv_heads, head, vocab, family.gemma4, family.experts)
        if not tied:
            yield "output.weight", -1, (vocab, hidden)
        return
    if family.longrope:  # (a factor a rotary pair of the latent attention's rotary part)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            yield name, -1, (family.latent[3] // 2,)
    q_rows = 2 * q if family.delta else q  # (Qwen3.5's query product gives a gate a head too)
    for i in range(layers):
        if family.jamba:  # a norm, an attention or Mamba's mixer with its norms, a norm, an MLP or experts
            every, at, routes_every, routes_at = family.jamba
            inner_width, state, rank, _ = family.selective
            mixer = (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                     ("attn_output", (hidden, q))) if i % every == at else (
                ("ssm_in", (2 * inner_width, hidden)), ("ssm_conv1d", (inner_width, QWEN35_CONV_TAPS)),
                ("ssm_conv1d.bias", (inner_width,)), ("ssm_x", (rank + 2 * state, inner_width)),
                ("ssm_dt_norm", (rank,)), ("ssm_dt", (inner_width, rank)), ("ssm_dt.bias", (inner_width,)),
                ("ssm_b_norm", (state,)), ("ssm_c_norm", (state,)), ("ssm_a", (inner_width, state)),
                ("ssm_d", (inner_width,)), ("ssm_out", (hidden, inner_width)))
            for name, shape in (("attn_norm", (hidden,)), *mixer, ("ffn_norm", (hidden,)),
                                *(mlp if i % routes_every == routes_at else dense)):
                kindless = name in ("ssm_a", "ssm_d") or name.endswith(".bias")  # (ssm_a's and ssm_d's have none)
                yield f"blk.{i}.{name}" + ("" if kindless else ".weight"), i, shape
            continue
        if family.selective:  # a norm, then Mamba's selective-scan mixer
            inner_width, state, rank, _ = family.selective
            for name, shape in (("attn_norm.weight", (hidden,)), ("ssm_in.weight", (2 * inner_width, hidden)),
                                ("ssm_conv1d.weight", (inner_width, QWEN35_CONV_TAPS)),
                                ("ssm_conv1d.bias", (inner_width,)), ("ssm_x.weight", (rank + 2 * state, inner_width)),
                                ("ssm_dt.weight", (inner_width, rank)), ("ssm_dt.bias", (inner_width,)),
                                ("ssm_a", (inner_width, state)), ("ssm_d", (inner_width,)),
                                ("ssm_out.weight", (hidden, inner_width))):
                yield f"blk.{i}.{name}", i, shape
            continue
        if family.pattern:  # Nemotron-H: a norm, then one of a Mamba2 mixer, an attention or an MLP
            yield from ((f"blk.{i}.{name}", i, shape) for name, shape in single_purpose_layer(
                family.pattern[i], hidden, inner, q, kv, family))
            continue
        if family.delta and (i + 1) % QWEN35_ATTENTION_EVERY:  # a delta-rule layer, then the MLP
            key_heads, value_heads, width = family.delta
            conv, values = 2 * key_heads * width + value_heads * width, value_heads * width
            for name, shape in (("attn_norm.weight", (hidden,)), ("attn_qkv.weight", (conv, hidden)),
                                ("attn_gate.weight", (values, hidden)), ("ssm_conv1d.weight", (conv, QWEN35_CONV_TAPS)),
                                ("ssm_dt.bias", (value_heads,)), ("ssm_a", (value_heads,)),
                                *((("ssm_ba.weight", (2 * value_heads, hidden)),) if family.arch == "qwen3next"
                                  else (("ssm_beta.weight", (value_heads, hidden)),
                                        ("ssm_alpha.weight", (value_heads, hidden)))),
                                ("ssm_norm.weight", (width,)), ("ssm_out.weight", (hidden, values)),
                                *((f"{n}.weight", s) for n, s in ((family.mlp_norm, (hidden,)), *mlp))):
                yield f"blk.{i}.{name}", i, shape
            continue
        if family.arch == "falcon-h1":  # attention and Mamba2 side by side (its answers gated, not normed), the MLP
            mixer = [t for t in mamba2_tensors(hidden, family.mamba) if t[0] != "ssm_norm.weight"]
            for name, shape in (("attn_norm.weight", (hidden,)), ("attn_q.weight", (q, hidden)),
                                ("attn_k.weight", (kv, hidden)), ("attn_v.weight", (kv, hidden)),
                                ("attn_output.weight", (hidden, q)), *mixer, ("ffn_norm", (hidden,)),  # (no kind)
                                *((f"{n}.weight", s) for n, s in mlp)):
                yield f"blk.{i}.{name}", i, shape
            continue
        if family.mamba and i not in family.attending:  # a Mamba2 layer, then the MLP
            for name, shape in (("attn_norm.weight", (hidden,)), *mamba2_tensors(hidden, family.mamba),
                                *((f"{n}.weight", s) for n, s in ((family.mlp_norm, (hidden,)), *mlp))):
                yield f"blk.{i}.{name}", i, shape
            continue
        if family.attending is not None and i not in family.attending:  # a short convolution, then the MLP
            for name, shape in (("attn_norm", (hidden,)), ("shortconv.in_proj", (3 * hidden, hidden)),
                                ("shortconv.conv", (hidden, CONV_TAPS)), ("shortconv.out_proj", (hidden, hidden)),
                                (family.mlp_norm, (hidden,)), *(dense if i < family.dense_lead else mlp)):
                yield f"blk.{i}.{name}.{'bias' if name == 'exp_probs_b' else 'weight'}", i, shape
            continue
        if family.latent:  # DeepSeek's latent attention, then the MLP
            for name, shape in (("attn_norm", (hidden,)),
                                *latent_attention(hidden, heads, family.latent, whole=family.arch == "minicpm3"),
                                (family.mlp_norm, (hidden,)), *(dense if i < family.dense_lead else mlp)):
                yield f"blk.{i}.{name}.{'bias' if name == 'exp_probs_b' else 'weight'}", i, shape
            continue
        qkv = (("attn_qkv", (q_rows + 2 * kv, hidden)),) if family.fused_qkv else (
            ("attn_q", (q_rows, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)))
        for name, shape in (("attn_norm", (hidden,)), *qkv, ("attn_output", (hidden, q)), (family.mlp_norm, (hidden,)),
                            *(dense if i < family.dense_lead else mlp)):
            if name in ("attn_norm", family.mlp_norm) and not family.input_norms or (
                    name == family.mlp_norm and family.parallel):
                continue
            yield f"blk.{i}.{name}.{'bias' if name == 'exp_probs_b' else 'weight'}", i, shape
            if family.biases and name in ("attn_q", "attn_k", "attn_v", "attn_qkv") or family.all_biases and name in (
                    "attn_output", "ffn_up", "ffn_down") or family.layer_norm == "biased" and name in (
                    "attn_norm", family.mlp_norm):
                yield f"blk.{i}.{name}.bias", i, shape[:1]
            if family.sinks and (name == "attn_output" or name.startswith("ffn_")):  # (a stack's: a row an expert)
                yield f"blk.{i}.{name}.bias", i, shape[:-1]
            if family.sinks and name == "attn_output":
                yield f"blk.{i}.attn_sinks.weight", i, (heads,)
            if family.attention_gate and name == "attn_output":
                yield f"blk.{i}.attn_gate.weight", i, (q, hidden)
            if family.head_norms and name in ("attn_q", "attn_k"):
                yield f"blk.{i}.{name}_norm.weight", i, shape[:1] if family.norms_across_heads else (head,)
            if family.head_layer_norms and name in ("attn_q", "attn_k"):
                yield f"blk.{i}.{name}_norm.weight", i, (heads if name == "attn_q" else kv_heads, head)
            if family.output_norms and name in ("attn_output", "ffn_down", "ffn_down_exps"):
                yield f"blk.{i}.{'post_attention_norm' if name == 'attn_output' else 'post_ffw_norm'}.weight", i, (hidden,)
    lfm2 = family.attending is not None and not family.mamba  # (LFM2's final norm by llama.cpp's name for it)
    yield "token_embd_norm.weight" if lfm2 else "output_norm.weight", -1, (hidden,)
    if family.layer_norm == "biased":
        yield "output_norm.bias", -1, (hidden,)
    if not tied:
        yield "output.weight", -1, (vocab, hidden)
        if family.all_biases and family.arch == "phi2":  # (Phi-2's output layer's own bias)
            yield "output.bias", -1, (vocab,)


def write(shape: str, fmt: str, out: Path, seed: int = 0, vocab: int | None = None) -> Path:
    hidden, inner, layers, heads, kv_heads = SHAPES[shape]
    source = GGUFFile(default_model_path()).metadata
    tokens, types = list(source["tokenizer.ggml.tokens"]), source["tokenizer.ggml.token_type"].tolist()
    if vocab is not None:
        if vocab < len(tokens):
            raise SystemExit(f"--vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
        tokens += [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
        types += [3] * (vocab - len(types))  # llama.cpp's CONTROL: never produced by encoding text
    vocab = len(tokens)
    padded = f"-vocab{vocab}" if vocab != len(source["tokenizer.ggml.tokens"]) else ""
    path = out / f"random-{shape}-{fmt}{padded}.gguf"
    family, tied = layout(shape), shape not in UNTIED
    head = family.head or hidden // heads
    writer = gguf.GGUFWriter(str(path), family.arch)
    writer.add_name(f"random {shape} ({fmt})")
    writer.add_file_type(FILE_TYPES[fmt])
    writer.add_context_length(family.context)
    writer.add_embedding_length(hidden)
    # (Nemotron-H's a layer at a time: an MLP or experts layer's width, none elsewhere)
    shared = min(family.gemma4[3], layers - 2) if family.gemma4 else 0  # (a cut file keeps two layers of K/V)
    if family.gemma4:
        family = replace(family, gemma4=(*family.gemma4[:3], shared, *family.gemma4[4:]))
    writer.add_feed_forward_length([inner if c in "-E" else 0 for c in family.pattern[:layers]] if family.pattern
                                   else [inner * (2 if family.gemma4[4] and i >= layers - shared else 1)
                                         for i in range(layers)] if family.gemma4 else inner)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    if family.delta:  # its delta-rule layers' sizes, a rotary over a quarter of a head (llama.cpp's sections)
        key_heads, value_heads, width = family.delta
        writer.add_ssm_conv_kernel(QWEN35_CONV_TAPS)
        writer.add_ssm_state_size(width)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * width)
        writer.add_full_attention_interval(QWEN35_ATTENTION_EVERY)
        if family.arch != "qwen3next":  # (Qwen3.5's rotary in sections, Qwen3-Next's a plain one)
            writer.add_array(f"{family.arch}.rope.dimension_sections", [11, 11, 10, 0])
    if family.mamba:  # its Mamba2 layers' sizes; attention without rotary (Granite 4.0 H's)
        ssm_heads, width, state, groups = family.mamba
        writer.add_ssm_conv_kernel(QWEN35_CONV_TAPS)
        writer.add_ssm_state_size(state)
        writer.add_ssm_group_count(groups)
        writer.add_ssm_time_step_rank(ssm_heads)
        writer.add_ssm_inner_size(ssm_heads * width)
        if family.pattern:  # (llama.cpp's Nemotron-H requires the plain epsilon)
            writer.add_layer_norm_eps(family.eps)
        elif family.arch != "falcon-h1":
            writer.add_rope_scaling_finetuned(False)
    if family.selective:  # its layers' sizes
        inner_width, state, rank, normed = family.selective
        writer.add_ssm_conv_kernel(QWEN35_CONV_TAPS)
        writer.add_ssm_inner_size(inner_width)
        writer.add_ssm_state_size(state)
        writer.add_ssm_time_step_rank(rank)
        writer.add_ssm_dt_b_c_rms(normed)
    if family.vision_sections:
        writer.add_array(f"{family.arch}.rope.dimension_sections", list(family.vision_sections))
    if family.deepstack:
        writer.add_uint32(f"{family.arch}.n_deepstack_layers", family.deepstack)
    if family.gemma4:  # its global layers' heads and size, the sliding ones' as *_swa, its layers' kinds
        global_head, global_kv, _, _, _, width, _ = family.gemma4
        kinds = gemma4_layer_kinds(layers, family.gemma4)
        writer.add_head_count_kv([global_kv or kv_heads if g else kv_heads for g in kinds])
        writer.add_sliding_window_pattern([not g for g in kinds])
        writer.add_shared_kv_layers(shared)
        writer.add_embedding_length_per_layer_input(width)
        for name in ("key_length_swa", "value_length_swa"):
            writer.add_uint32(f"gemma4.attention.{name}", head)
        writer.add_uint32("gemma4.rope.dimension_count_swa", head)
        writer.add_float32("gemma4.rope.freq_base_swa", 10000.0)
    elif family.gemma3n:  # its layers' kinds, the layers reading earlier ones' K/V, the per-layer inputs' width
        width, _, streams, reading, every = family.gemma3n
        writer.add_head_count_kv(kv_heads)
        writer.add_sliding_window_pattern([(i + 1) % every != 0 for i in range(layers)])
        writer.add_shared_kv_layers(min(reading, layers - 2))
        writer.add_embedding_length_per_layer_input(width)
        writer.add_altup_active_idx(0)
        writer.add_altup_num_inputs(streams)
        writer.add_activation_sparsity_scale([1.6448533535003662] * min(10, layers) + [float("-inf")] * (layers - 10))
    elif family.pattern:  # K/V heads in the attention layers alone
        writer.add_head_count_kv([kv_heads if c == "*" else 0 for c in family.pattern[:layers]])
    elif family.jamba:  # (none in a Mamba layer, as for LFM2's and Granite 4's below)
        every, at, _, _ = family.jamba
        writer.add_head_count_kv([kv_heads if i % every == at else 0 for i in range(layers)])
    elif family.attending is not None:  # (none in a convolution or Mamba2 layer: how llama.cpp tells them apart)
        writer.add_head_count_kv([kv_heads if i in family.attending else 0 for i in range(layers)])
        if not family.mamba:
            writer.add_uint32(f"{family.arch}.shortconv.l_cache", CONV_TAPS)
    else:
        writer.add_head_count_kv(kv_heads)
    if family.latent:  # one K/V head: the latent and the key's rotary part (a head's widths as MLA's lengths)
        q_rank, kv_rank, nope, rotary, value = family.latent
        if q_rank is not None:
            writer.add_q_lora_rank(q_rank)
        writer.add_kv_lora_rank(kv_rank)
        if family.arch == "minicpm3":  # (its converter's: a query head's width as the key length, no value length)
            writer.add_key_length(nope + rotary)
        else:
            writer.add_key_length(kv_rank + rotary)
            writer.add_value_length(kv_rank)
            writer.add_key_length_mla(nope + rotary)
            writer.add_value_length_mla(value)
        writer.add_rope_dimension_count(rotary)
    else:  # (Gemma 4's: its global layers' heads, which rotate whole, some pairs by a frequency of nearly 0)
        key_length = family.gemma4[0] if family.gemma4 else head
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
        writer.add_rope_dimension_count(key_length // 4 if family.delta else int(key_length * family.rotary_share))
    writer.add_rope_freq_base(family.rope_base)
    if family.layer_norm:
        writer.add_layer_norm_eps(family.eps)
        if family.arch == "gptneox":  # (llama.cpp requires it)
            writer.add_bool("gptneox.use_parallel_residual", True)
    else:
        writer.add_layer_norm_rms_eps(family.eps)
    if family.window:
        writer.add_sliding_window(family.window)
    if family.window_pattern:
        writer.add_sliding_window_pattern(family.window_pattern)
    if family.logit_scale:
        writer.add_logit_scale(family.logit_scale)
    if family.clamp_kqv:
        writer.add_clamp_kqv(family.clamp_kqv)
    if family.alibi_max_bias:
        writer.add_max_alibi_bias(family.alibi_max_bias)
    if family.soft_caps:  # (an attention cap of 0: none, Gemma 4's)
        if family.soft_caps[0]:
            writer.add_attn_logit_softcapping(family.soft_caps[0])
        writer.add_final_logit_softcapping(family.soft_caps[1])
    if family.scales:
        embeddings, residuals, attention, logits = family.scales
        writer.add_embedding_scale(embeddings)
        writer.add_residual_scale(residuals)
        writer.add_attention_scale(attention)
        writer.add_logit_scale(logits)
    if family.experts:
        count, used, width = family.experts
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
    if family.shared_expert:
        writer.add_expert_shared_feed_forward_length(family.shared_expert)
    if family.arch == "nemotron_h_moe":  # (its converter's keys: one shared expert, weights renormalised and scaled)
        writer.add_expert_shared_count(1)
        writer.add_expert_weights_scale(family.sigmoid[0])
        writer.add_expert_weights_norm(family.sigmoid[1])
        writer.add_expert_group_count(1)
        if family.expert_latent:
            writer.add_moe_latent_size(family.expert_latent)
    if family.arch == "ernie4_5-moe":  # (llama.cpp requires the step)
        writer.add_leading_dense_block_count(family.dense_lead)
        writer.add_interleave_moe_layer_step(1)
    if family.arch == "llama4":  # (llama.cpp requires the step: Scout's every layer)
        writer.add_interleave_moe_layer_step(1)
    if family.arch == "cohere2moe":  # (its converter's: the window layers a flag a layer; llama.cpp requires the rest)
        writer.add_sliding_window_pattern([(i + 1) % 4 != 0 for i in range(layers)])
        writer.add_leading_dense_block_count(family.dense_lead)
        writer.add_expert_shared_count(family.shared_experts)
    # (llama.cpp requires DeepSeek's, GLM-4.5's and dots.llm1's shared count; the gating function where it is not
    # V2's softmax)
    if family.latent and family.arch != "minicpm3" or family.arch in ("glm4moe", "dots1", "afmoe", "exaone-moe"):
        writer.add_leading_dense_block_count(family.dense_lead)
        writer.add_expert_shared_count(family.shared_experts)
        if family.sigmoid:
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            writer.add_expert_weights_scale(family.sigmoid[0])
            writer.add_expert_weights_norm(family.sigmoid[1])
    if family.xielu:  # (the checkpoints' alphas, before softplus, and beta and eps, a value a layer)
        writer.add_xielu_alpha_p([float(np.log(np.expm1(0.8)))] * layers)
        writer.add_xielu_alpha_n([float(np.log(np.expm1(0.3)))] * layers)
        writer.add_xielu_beta([0.5] * layers)
        writer.add_xielu_eps([-1e-6] * layers)
    if family.arch == "hunyuan-moe":  # (its converter's)
        writer.add_expert_shared_count(1)
    if family.arch == "minimax-m2":  # (llama.cpp requires the gating function)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family.arch == "lfm2moe":  # (llama.cpp requires the gating function)
        writer.add_leading_dense_block_count(family.dense_lead)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family.yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(family.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(family.yarn[1])
        if family.yarn[2] is not None:
            writer.add_rope_scaling_yarn_log_mul(family.yarn[2])
    if family.temperature:
        writer.add_attn_temperature_scale(family.temperature)
    if family.linear_rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(family.linear_rope)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(source["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(source["tokenizer.chat_template"])
    plan = [(name, tensor_type(name, layer, layers, fmt, size[-1], tied, heads // max(kv_heads, 1)), size) for name, layer, size in
            tensors(hidden, inner, layers, heads, kv_heads, head, vocab, family, tied)]
    for name, kind, size in plan:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(size)) // block * block_bytes
        if kind in (Q.F32, Q.F16):
            writer.add_tensor_info(name, size, np.dtype(np.float32 if kind == Q.F32 else np.float16), nbytes)
        else:  # gguf-py takes a quantized tensor's shape in bytes
            writer.add_tensor_info(name, (*size[:-1], size[-1] // block * block_bytes), np.dtype(np.uint8), nbytes,
                                   raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, kind, size in plan:
        # (a shared expert's one-row router small as a bias, not a norm's ones)
        # (Mamba's time steps as trained ones are, small: its input-dependent part a tenth of the usual weights',
        # its bias as initialised; the usual sizes make steps of 50 and activations past float32's range)
        selective = family.selective is not None
        if name.startswith("rope_factors_"):  # (longrope's: a rotary pair's wavelength stretched by 1 to 4)
            writer.write_tensor_data(rng.uniform(1.0, 4.0, size).astype(np.float32))
            continue
        if name == "rope_freqs.weight":  # (Gemma 4's proportional rope: a quarter of the pairs turn, 1e30 stills the rest)
            turning = size[0] // 4
            writer.write_tensor_data(np.array([1.0] * turning + [1e30] * (size[0] - turning), np.float32))
            continue
        writer.write_tensor_data(tensor_data(kind, size, rng, bias=name.endswith((".bias", "_inp_shexp.weight")),
                                             decays=name.endswith(".ssm_a"),
                                             time_steps=selective and name.endswith(".ssm_dt.bias"),
                                             scale=0.1 if selective and name.endswith(("ssm_x.weight", "ssm_dt.weight"))
                                             else 1.0))
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--format", choices=FILE_TYPES, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gguf"))
    parser.add_argument("--vocab", type=int, default=None, help="pad the vocabulary to this many tokens")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = write(args.shape, args.format, args.out, vocab=args.vocab)
    print(f"{path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
