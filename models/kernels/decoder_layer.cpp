// A model's decoder layers for a step of decode rows and short prefill chunks (a chunk's tokens are
// rows of its sequence), in one call and one parallel region: Llama's family and GPT-2. A layer:
// norm, the q/k/v product, rotary (Llama) + K/V writes into the pool, decode attention, the output
// product and residual, norm, the MLP's up product, its activation, the down product and residual
// (LFM2's convolution layers: their short convolution in the attention's place, short_convolution.h;
// Qwen3.5's delta-rule layers and Granite 4's Mamba2 layers: their recurrence in the attention's place,
// delta_rule.h, mamba_scan.h).
//
// At one or a few rows the layer's arithmetic is small and its weights stream in about 0.5 ms; run
// as ~16 torch operators and 6 ctypes calls it also paid ~0.2 ms of dispatch per layer, a quarter
// of a one-stream step (docs/benchmarks.md, "Small-batch products"). Here the phases are separated
// by the implicit barriers of their work-sharing loops, and the threads stay in one team throughout;
// with enough rows each thread takes its own rows through every layer instead (decoder_layers).
// The torch paths (models/families/llama.py, gpt2.py) remain the reference and run every step with a
// longer prefill chunk.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <omp.h>
#ifdef __linux__
#include <sched.h>
#endif

#include "block_weights.h"
#include "cpu_linear.h"
#include "delta_rule.h"
#include "mamba_scan.h"
#include "selective_scan.h"
#include "paged_decode.h"
#include "short_convolution.h"

namespace {

// A product's weights: up to MAX_PARTS parts stacked by output rows, each T values [rows, in] (format
// FLOAT) or blocks of a format (block_codes.h; float models only). A fused q/k/v whose parts a file
// keeps in different formats (Q4_K_M's Q6_K values beside Q4_K queries and keys) has several; AFMoE's four, its
// attention's gate between the queries and the keys.
constexpr int MAX_PARTS = 4;
struct Weights {
    struct Part {
        const void* data;
        int64_t format, rows;
    };
    int64_t parts;
    Part part[MAX_PARTS];
};

// How the MLP activates its up product: GPT-2's GELU (tanh), Nemotron-H's squared ReLU, GPT-NeoX's and Falcon's
// GELU (erf, exact), Apertus's xIELU (a layer's own four numbers: Layer's xielu), or a gated MLP whose ``up``
// product gives [gate | up] (2 x intermediate outputs): Llama's SiLU(gate) x up, Gemma's GELU(gate) x up, gpt-oss's
// experts' clamped SwiGLU (Experts' alpha and limit).
enum Activation : int64_t { GELU_TANH = 0, SILU_GATED = 1, GELU_TANH_GATED = 2, CLAMPED_SWIGLU = 3, RELU_SQUARED = 4,
                            GELU_ERF = 5, XIELU = 6 };

// Whether an activation reads one value a unit (else a gate and an up value).
inline bool ungated(int64_t activation) {
    return activation == GELU_TANH || activation == RELU_SQUARED || activation == GELU_ERF || activation == XIELU;
}

// A mixture's routed experts in a layer's MLP's place (Mixtral, Qwen3-MoE, gpt-oss; decoder_layer.py
// fills it): the router's product (plus router_bias, where not null) gives each row ``count`` logits;
// a row goes to the top_k experts of their softmax, weighted by their probabilities (renormalised to
// sum to 1 where ``normalize``). Expert e is a SwiGLU: gate_up[e] gives [gate | up] (2 x the layer's
// intermediate outputs), down[e] the hidden ones; with biases (gpt-oss's; null elsewhere) expert e's
// are rows e of gate_up_bias [count, 2 x intermediate] and down_bias [count, hidden], in the model's
// type. ``activation``: SILU_GATED, CLAMPED_SWIGLU with ``alpha`` and ``limit``, or RELU_SQUARED (Nemotron
// 3's: gate_up[e] gives the up outputs alone). A shared expert (Qwen2-MoE's, Granite MoE Shared's; shared_gate_up
// null elsewhere) is a SwiGLU every row takes (a squared ReLU where the routed ones are), shared_intermediate
// wide, added to the routed ones' output: weighted by the sigmoid of shared_gate's one logit where that is not
// null (Qwen2-MoE's), as it is otherwise; times ``shared_scale`` (Cohere2-MoE's average: 0.5).
// ``selection_bias`` (ERNIE 4.5's; null elsewhere): an expert's bias [count], in the model's type, added to its
// probability to choose a row's top_k, not to weigh them. With ``sigmoid`` (LFM2-MoE's) an expert's probability is the
// sigmoid of its logit, not their softmax. The chosen weights are multiplied by ``routed_scale``, and by
// their expert's ``expert_scales`` where that is not null (Gemma 4's). With ``beside`` (Gemma 4's 26B-A4B)
// the experts sit beside the layer's MLP, over its input (the residual after the attention): routed on
// it normed with ``route_norm`` (router.scale / sqrt(hidden): a norm without a weight, then that scale),
// run on it normed with ``pre_norm``, their sum normed with ``post_norm`` and added to the MLP's output
// normed with ``dense_norm``; all four in the model's type; an expert ``intermediate`` wide, the MLP the layer's.
// With ``latent`` (Nemotron 3 Super's; 0 elsewhere) the routed experts work ``latent`` values wide: their input
// the rows through ``latent_down``, their weighted sum back through ``latent_up`` (the router and the shared
// expert read the rows themselves). With ``weights_inputs`` (Llama 4's) each chosen expert reads its row times its
// weight, and its output is added as it is.
struct Experts {
    const Weights* router;
    const Weights* gate_up;  // count of them
    const Weights* down;     // count of them
    const void *router_bias, *gate_up_bias, *down_bias, *selection_bias;
    const Weights *shared_gate_up, *shared_down, *shared_gate;
    const void *expert_scales, *route_norm, *pre_norm, *post_norm, *dense_norm;
    const Weights *latent_down, *latent_up;
    int64_t count, top_k, normalize, activation, shared_intermediate, sigmoid, beside;
    int64_t intermediate;  // an expert's width where it is not the layer's (beside an MLP of its own; else 0)
    int64_t latent;
    double alpha, limit, routed_scale;
    int64_t weights_inputs;  // 1: the chosen weights scale the experts' inputs, not their outputs (Llama 4's)
    double shared_scale;     // the shared expert's output times this (Cohere2-MoE's average: 0.5; 1 elsewhere)
};

// Qwen3.5's and Qwen3-Next's gated delta rule in the attention's place (delta_rule.h; decoder_layer.py fills
// it): the layer's qkv product gives its q, k and v, its out product reads its answers; these are its other
// three products (z, beta's and alpha's logits), its parameters in the layers' type, and this layer's states
// in the pool (set where the pool is bound): the convolution's last inputs and the heads' matrices.
struct DeltaLayer {
    const Weights *z, *beta, *alpha;
    const void *conv, *dt_bias, *decay_rate, *norm;
    void *conv_states, *states;
    int64_t key_heads, heads, key_dim, value_dim, taps, grouped;  // (grouped: DeltaMixer's)
    double eps;

    int64_t conv_width() const { return 2 * key_heads * key_dim + heads * value_dim; }
};

// A Mamba2 layer (mamba_scan.h; decoder_layer.py fills it): in the attention's place (Granite 4's), the layer's
// qkv product is its input product ([z | x, B, C | dt]) and its out product reads its answers; beside the
// attention (Falcon-H1's ``mamba_beside``), its own ``in`` and ``out``. These are its parameters in the layers'
// type (conv_bias, norm may be null) and this layer's states in the pool (set where the pool is bound): the
// convolution's last inputs and the heads' matrices.
struct MambaLayer {
    const void *conv, *conv_bias, *dt_bias, *decay, *skip, *norm;  // (norm null: its answers gated alone)
    void *conv_states, *states;
    const Weights *in, *out;  // its own products beside an attention (Falcon-H1's; null in the attention's place)
    int64_t heads, head_dim, state_size, groups, taps;
    double eps;

    int64_t inner() const { return heads * head_dim; }
    int64_t conv_width() const { return inner() + 2 * groups * state_size; }
    int64_t projection() const { return inner() + conv_width() + heads; }
};

// Mamba's selective-scan mixer in the attention's place (families/mamba.py; decoder_layer.py fills it): the qkv
// product is its input product ([x | z], inner each), the out product its output product; x convolved through a
// SiLU (``taps`` inputs, the last ones a sequence's in ``conv_states``), its x_proj product [time step's low rank |
// B | C] (each normed where ``normed``: Falcon-Mamba's without weights, Jamba's with), the time steps widened by
// dt_proj (plus dt_bias) through a softplus, the scan over ``states`` (selective_scan.h), its answers gated by
// SiLU(z). (Jamba's layers take an MLP or experts after it; Mamba's none.)
struct SelectiveLayer {
    const Weights *x_proj, *dt_proj;
    const void *conv, *conv_bias, *dt_bias, *decay, *skip;
    const void *dt_norm, *b_norm, *c_norm;  // where ``normed``, the norms' weights (Jamba's; null: Falcon-Mamba's)
    void *conv_states, *states;
    int64_t inner, state_size, rank, taps, normed;
    double eps;

    int64_t steps_width() const { return rank + 2 * state_size; }
};

// DeepSeek's latent attention in the attention's place (decoder_layer.py fills it; families/deepseek.py says how it
// runs). The layer's qkv product gives each row's queries, a head's values that do not rotate (nope) then those that
// do (rope), or, where q_up is not null, their low rank (q_rank values), which q_norm normalises and q_up takes to
// the queries; kv_down gives the latent (kv_rank values, which kv_norm normalises) and the keys' rotary part. k_up
// and v_up are stacks of a matrix a head in one Weights part each: head h's query into the latent's space
// ([kv_rank, nope]) and its values out of it ([value, kv_rank]). The pool keeps a token's [rotary part | latent]
// in one key head of the layer's dim (rope + kv_rank) values, and again as its value; the out product reads the
// heads' values.
struct LatentLayer {
    const Weights *q_up, *kv_down, *k_up, *v_up;
    const void *q_norm, *kv_norm;
    int64_t q_rank, kv_rank, nope, rope, value;
    double eps;  // the latent's and the low-rank queries' norms'

    int64_t queries(int64_t heads) const { return heads * (nope + rope); }
};

// Gemma 3n's (families/gemma3n.py): the hidden state is ``streams`` rows of the hidden size a token (AltUp). A
// layer predicts each stream as itself plus a mix of all of them (predict_coefs [streams^2, streams] over the
// active stream's modalities: tanh of ``router`` over it normed by router_norm and scaled by 1 / hidden), runs on
// the active (first) stream's prediction with Laurel beside its attention (laurel_left, laurel_right, normed by
// laurel_norm, added to the normed input; its sum with the attention's residual times 1 / sqrt(2)) and, where
// ``sparse``, its MLP's gate cut at its mean plus cutoff_stds standard deviations; then corrects each stream's
// prediction by the innovation (the layer's output less the active prediction) times (correct_coefs over the
// output's modalities) + 1, and adds the per-layer input, gated by the corrected active stream times
// correct_scale (null: 1), to the other streams.
struct AltUpLayer {
    const Weights *router, *laurel_left, *laurel_right;
    const void *router_norm, *predict_coefs, *correct_coefs, *correct_scale, *laurel_norm;
    int64_t streams, laurel_rank, sparse;
    double cutoff_stds;
};
constexpr int64_t MOST_STREAMS = 8;  // (decoder_layer.py attaches no native layers for more)

// Head h's matrix of a stack of the heads' matrices (one part, ``rows`` rows of ``in`` values a head).
template <typename T>
Weights head_weights(const Weights& stack, int64_t h, int64_t rows, int64_t in) {
    const Weights::Part& p = stack.part[0];
    const int64_t row = std::is_same_v<T, float> ? format_row_bytes(p.format, in) : int64_t(sizeof(T)) * in;
    return Weights{1, {{static_cast<const uint8_t*>(p.data) + h * rows * row, p.format, rows}}};
}

// One layer's weights and shape, filled once at load (decoder_layer.py mirrors this layout: every
// field is 8 bytes). Biases may be null; the pool keeps its elements as C (kv_element.h). Llama's
// family: RMSNorms, SILU_GATED; Qwen3 normalises each head's query and key (q_norm, k_norm: null
// elsewhere), OLMo all heads' queries and all keys as one (norms_across_heads), and has no norm
// before the attention or the MLP (input_norm, post_norm: null), its outputs' norms as Gemma's.
// Gemma: its attention's and MLP's outputs normalised before they are added
// (attn_out_norm, mlp_out_norm: null elsewhere), GELU_TANH_GATED; Gemma 3's q/k norms and its layers
// with a sliding window rotating by angles of their own (window_angles: the step's
// window_cos/window_sin); Gemma 2's attention scores soft-capped (softcap: 0 elsewhere). A layer that
// does not rotate (rotates 0: SmolLM3's every fourth) stores its keys and reads its queries as they
// are; Granite's outputs are scaled before they are added (residual_scale: 1 elsewhere). A layer
// with routed experts (experts: null elsewhere) has no up or down product of its own; gpt-oss's
// attention takes a sink a head in its softmax (sinks: null elsewhere). Norm weights
// are the factors applied (Gemma's 1 + weight, decoder_layer.py makes them). GPT-2: LayerNorms with
// biases, GELU_TANH. A layer without an MLP (up and experts null: a Nemotron-H mixer that no MLP layer
// follows) ends at its mixer's residual. Gemma 4: each head's values normalised without a weight (value_norm);
// its global layers' values their keys before the keys' norm (values_are_keys: the qkv product gives queries
// and keys alone); its last layers read an earlier layer's K/V and store none (reads_kv: the qkv product gives
// queries alone, k_cache and v_cache are that layer's); after the MLP, a per-layer input (per_layer_gate: null
// elsewhere) gelu(x gate^T) x the step's per-layer inputs at per_layer_offset, through per_layer_out, normed by
// per_layer_norm and added; and the layer's output scaled (layer_scale: 1 elsewhere). Phi-2's and Cohere's MLP
// (``parallel``) reads the input norm's output beside the attention, both added to the residual (no post_norm).
// HunYuan's q/k norms come after the rotation (norms_after_rotation): its queries and keys are turned in place,
// normed, and stored as they are.
template <typename T, typename C>
struct Layer {
    const T *input_norm, *input_norm_bias, *post_norm, *post_norm_bias;
    const Weights* qkv;
    const T* qkv_bias;
    const Weights* out;
    const T* out_bias;
    const Weights* up;
    const T* up_bias;
    const Weights* down;
    const T* down_bias;
    const T *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm;
    C *k_cache, *v_cache;
    const Experts* experts;
    const T* sinks;  // gpt-oss's attention sinks, a logit a query head (null elsewhere)
    // LFM2's short convolution in the attention's place (null elsewhere): its taps [hidden, conv_taps],
    // their bias (null: none) and the layer's rows in the pool (short_convolution.h); the qkv product
    // is then its input product (B, C and x), the out product its output product
    const T *conv, *conv_bias;
    C* conv_cache;
    // Qwen3.5's delta rule in the attention's place (null elsewhere); its attention layers' queries come
    // with a gate a head (``gated``: the qkv product gives [queries | gates | keys | values]), the heads'
    // values times its sigmoid before the output product
    const DeltaLayer* delta;
    const MambaLayer* mamba;  // Granite 4's Mamba2 in the attention's place (null elsewhere)
    const MambaLayer* mamba_beside;  // Falcon-H1's Mamba2 beside the attention, over its input (null elsewhere)
    const LatentLayer* latent;  // DeepSeek's latent attention in the attention's place (null elsewhere)
    const SelectiveLayer* selective;  // Mamba's selective-scan mixer in the attention's place (null elsewhere)
    const Weights *per_layer_gate, *per_layer_out;  // Gemma 4's and 3n's per-layer input's products (null elsewhere)
    const T* per_layer_norm;
    const AltUpLayer* altup;  // Gemma 3n's (null elsewhere)
    int64_t hidden, intermediate, heads, kv_heads, dim, window, layer_norm, activation, window_angles, rotates,
        norms_across_heads, conv_taps, gated, values_are_keys, value_norm, reads_kv, per_layer_offset,
        per_layer_width, parallel, norms_after_rotation;
    double eps, scale, softcap, residual_scale, layer_scale;
    // Apertus's xIELU (XIELU): its positive side's factor, its negative side's, beta and eps, as the activation
    // uses them (the checkpoint's alphas through softplus, the negative one's plus beta)
    double xielu[4];
    double clip_qkv;  // the queries, keys and values clamped to [-clip_qkv, clip_qkv] (OLMo 1.7's; 0: not)
    // each head's q/k norm a LayerNorm by weights of its own (q_norm, k_norm a row a head: StableLM 2 12B's,
    // Command R+'s; 0: an RMSNorm of weights every head shares)
    int64_t head_layer_norms;
    const T* slopes;  // each query head's ALiBi slope (BLOOM's, MPT's; null elsewhere), decode_attention_rows'
    // 1: the step's query scales not applied in this layer (Llama 4's rotating layers: its temperature is its
    // unrotated layers'); 0 where they are
    int64_t unscaled_queries;

    // the K/V heads the layer's qkv product gives and it stores (none where it reads another layer's)
    int64_t stored_kv_heads() const { return reads_kv ? 0 : kv_heads; }

    // the width of the first product's output (q/k/v, and the gates where gated; a convolution's B, C and
    // x; a delta rule's q, k and v; a Mamba2's z, x, B, C and dt; a latent attention's queries or their low
    // rank), and of the output product's input (the heads' values; a convolution's output; a delta rule's or a
    // Mamba2's answers), or of the queries in the pool's space (a latent attention's: heads x dim)
    int64_t mix_width() const {
        return conv != nullptr     ? 3 * hidden
               : selective != nullptr ? 2 * selective->inner
               : delta != nullptr  ? delta->conv_width()
               : mamba != nullptr  ? mamba->projection()
               : latent != nullptr ? (latent->q_up != nullptr ? latent->q_rank : latent->queries(heads))
                                   : ((gated ? 2 : 1) * heads + (values_are_keys ? 1 : 2) * stored_kv_heads()) * dim;
    }
    int64_t mixed_width() const {
        return conv != nullptr    ? hidden
               : selective != nullptr ? selective->inner
               : delta != nullptr ? delta->heads * delta->value_dim
               : mamba != nullptr ? mamba->inner()
                                  : heads * dim;
    }
};

// y = x w^T + b for one of a layer's products, a part of its weights at a time (a float model's
// through block_linear_rows, which takes float rows as well as blocks). ``scratch``:
// product_scratch_size(rows, in) elements shared by the team.
template <typename T>
void product(const T* x, int64_t x_stride, int64_t rows, const Weights& w, const T* bias, int64_t in, T* y,
             int64_t y_stride, T* scratch, int64_t panel_from) {
    int64_t first = 0;
    for (int64_t p = 0; p < w.parts; ++p) {
        const Weights::Part& part = w.part[p];
        const T* b = bias == nullptr ? nullptr : bias + first;
        if constexpr (std::is_same_v<T, float>)
            block_linear_rows(x, x_stride, rows, BlockWeights(part.data, part.format, in, part.rows), b, y + first,
                              y_stride, scratch, panel_from);
        else
            linear_rows(x, x_stride, rows, static_cast<const T*>(part.data), in, b, in, part.rows, y + first, y_stride,
                        scratch, panel_from);
        first += part.rows;
    }
}

// Elements of scratch a product of ``rows`` rows of width ``in`` takes, whatever its weights.
template <typename T>
int64_t product_scratch_size(int64_t rows, int64_t in) {
    if constexpr (std::is_same_v<T, float>) return std::max(block_scratch_size(rows, in), packed_size<T>(rows, in));
    return packed_size<T>(rows, in);
}

// The step's rows, filled once per step: angles (null when rotary_dim is 0; the window's, for layers
// with window_angles, null where none differ), each row's query scale (Ministral 3's temperature,
// rope.py's query_temperature: null where the model has none), pool slots, block tables (padded to
// the widest), context lengths, and the rows whose logits are sampled. A prefill
// chunk's tokens are rows of one sequence, each attending to its own prefix through the sequence's
// table, as decode rows do.
template <typename T>
struct Step {
    const T *cos, *sin, *window_cos, *window_sin, *query_scales;
    // Gemma 4's per-layer inputs, [rows, per_layer_stride] (each layer's at its per_layer_offset; null elsewhere)
    const T* per_layer_inputs;
    const int64_t *slots, *tables, *lens, *samples;
    // Where threads carry their own rows (decoder_layer.py chooses, and cuts where sequences start):
    // part t's rows are [shares[t], shares[t + 1]), ``parts`` of them; null: the team shares each phase.
    const int64_t* shares;
    // The rows where a sequence starts, ``start_count`` of them in order: where a thread may take
    // another's rows (decoder_layers).
    const int64_t* starts;
    const int64_t* state_slots;  // each row's state slot (a model with recurrent layers; null elsewhere)
    int64_t rows, rotary_dim, max_blocks, block_size, sampled, parts;
    int64_t panel_from;  // the model's panel threshold (cpu_linear.py)
    int64_t pass_rows;   // the most rows one pass through the layers takes (decoder_layers)
    int64_t start_count;
    int64_t take_rows;   // the fewest rows a thread takes from another's, or leaves it; 0: none taken
    int64_t taken;       // out: the rows threads took from each other in this step
    int64_t window_rotary_dim;  // the window angles' width (Gemma 4's local heads are narrower than its global)
    int64_t per_layer_stride;
};

// The output layer: the final norm (RMSNorm, or LayerNorm with a bias) and the product into the
// vocabulary; decoder_layer.py mirrors the layout. Gemma 3n's ``streams`` (1 elsewhere) are merged first: the
// others through their ``unembed`` products (streams - 1 of them), each rescaled to the first's root mean
// square, and all averaged.
template <typename T>
struct Head {
    const T *norm, *norm_bias;
    const Weights* weight;
    const T* bias;
    const Weights* unembed;
    int64_t vocab, layer_norm, streams;
    double eps;
};

// y = norm(x) * weight (+ bias) for one row of ``width`` (y may be x): RMSNorm, or LayerNorm (mean
// removed first); the sums in T as torch's are. A null weight multiplies by 1 (Gemma 4's values' norm).
template <typename T>
void norm_row(const T* x, const T* weight, const T* bias, bool layer_norm, double eps, T* y, int64_t width) {
    T mean = 0;
    if (layer_norm) {
        for (int64_t i = 0; i < width; ++i) mean += x[i];
        mean /= T(width);
    }
    T squares = 0;
    for (int64_t i = 0; i < width; ++i) squares += (x[i] - mean) * (x[i] - mean);
    const T inv = T(1) / std::sqrt(squares / T(width) + T(eps));
    for (int64_t i = 0; i < width; ++i) y[i] = (x[i] - mean) * inv * (weight != nullptr ? weight[i] : T(1));
    if (bias != nullptr)
        for (int64_t i = 0; i < width; ++i) y[i] += bias[i];
}

// y = norm(x (+ delta, kept in x)) * weight (+ bias), a row per task (norm_row).
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, const T* bias, bool layer_norm, double eps, T* y, int64_t rows,
               int64_t width) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * width;
        if (delta != nullptr)
            for (int64_t i = 0; i < width; ++i) xr[i] += delta[r * width + i];
        norm_row(xr, weight, bias, layer_norm, eps, y + r * width, width);
    }
}

// The rows' queries and keys, in place in qkv (rows ``stride`` apart; the queries' ``q_spans`` spans
// of ``q_dim``, then the keys' ``k_spans`` of ``k_dim``): RMSNorm of each span, before the rotation. A
// span a head, as Qwen3's q_norm and k_norm; or one span for all queries and one for all keys, as
// OLMo's. With ``head_layer_norms``, a LayerNorm of each span by weights of its own (q_norm and k_norm a row
// a head: StableLM 2 12B's, Command R+'s). A task per span (norm_row).
template <typename T>
void norm_spans(T* qkv, int64_t stride, int64_t rows, int64_t q_spans, int64_t k_spans, int64_t q_dim, int64_t k_dim,
                const T* q_norm, const T* k_norm, double eps, bool head_layer_norms = false) {
    const int64_t per_row = q_spans + k_spans;
#pragma omp for
    for (int64_t task = 0; task < rows * per_row; ++task) {
        const int64_t span = task % per_row;
        const bool query = span < q_spans;
        T* v = qkv + task / per_row * stride + (query ? span * q_dim : q_spans * q_dim + (span - q_spans) * k_dim);
        const T* weight = query ? q_norm : k_norm;
        if (head_layer_norms) weight += query ? span * q_dim : (span - q_spans) * k_dim;
        norm_row<T>(v, weight, nullptr, head_layer_norms, eps, v, query ? q_dim : k_dim);
    }
}

// ``vector(x, b)`` a vector at a time where T is float, then ``one(x, b)`` a value at a time, in place
// over the first ``intermediate`` values x of each of the rows (``stride`` apart); b points at the
// values ``intermediate`` further on (a gated MLP's up half, which a lambda reads where it is one).
// Floats go a vector at a time (exp_lanes): a scalar expf per element was ~1.6% of a 64-row step.
template <typename T, typename Vectors, typename Values>
void each_activation(T* up, int64_t stride, int64_t rows, int64_t intermediate, Vectors vector, Values one) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* a = up + r * stride;
        const T* b = a + intermediate;
        int64_t i = 0;
        if constexpr (std::is_same_v<T, float>)
            for (; i + Vector<float>::lanes <= intermediate; i += Vector<float>::lanes)
                Vector<float>::store(a + i, vector(Vector<float>::load(a + i), b + i));
        for (; i < intermediate; ++i) a[i] = one(a[i], b + i);
    }
}

// The MLP's activation, in place on the up product's rows (``stride`` apart): gated, [gate | up] ->
// act(gate) x up in the gate's place; silu(x) = x sigmoid(x), gelu_tanh(x) = x sigmoid(2u), u =
// sqrt(2/pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh(u)) with one exp where tanh costs several.
// gpt-oss's experts' (CLAMPED_SWIGLU): g sigmoid(alpha g) x (u + 1), g = min(gate, limit), u = up
// clamped to [-limit, limit].
template <typename T>
void activate_rows(T* up, int64_t stride, int64_t activation, int64_t rows, int64_t intermediate, double alpha = 0,
                   double limit = 0, const double* xielu = nullptr) {
    using V = Vector<float>;
    if (activation == XIELU) {  // x > 0: a x^2 + beta x; else (expm1(min(x, eps)) - x) a' + beta x
        const double positive = xielu[0], negative = xielu[1], beta = xielu[2], eps = xielu[3];
        each_activation(up, stride, rows, intermediate, [&](V::type x, const float*) {
            const V::type m = x < float(eps) ? x : V::type{} + float(eps);
            // expm1 by its series near 0, where exp(m) - 1 would lose the digits that matter
            const V::type series = m * (1.0f + m * (0.5f + m * (1.0f / 6.0f + m * (1.0f / 24.0f))));
            const V::type expm1 = m > -0.01f ? series : exp_lanes(m) - 1.0f;
            const V::type below = (expm1 - x) * float(negative) + float(beta) * x;
            return x > 0.0f ? float(positive) * x * x + float(beta) * x : below;
        }, [&](T x, const T*) {
            return x > T(0) ? T(positive) * x * x + T(beta) * x
                            : (std::expm1(std::min(x, T(eps))) - x) * T(negative) + T(beta) * x;
        });
        return;
    }
    if (activation == CLAMPED_SWIGLU) {
        const T a = T(alpha), top = T(limit);
        each_activation(up, stride, rows, intermediate, [&](V::type g, const float* b) {
            const V::type high = V::type{} + float(top), low = -high;
            V::type u = V::load(b);
            g = g < high ? g : high;
            u = u < high ? (u > low ? u : low) : high;
            return g / (1.0f + exp_lanes(-float(a) * g)) * (u + 1.0f);
        }, [&](T gate, const T* b) {
            const T g = std::min(gate, top), u = std::clamp(*b, -top, top);
            return g / (T(1) + std::exp(-a * g)) * (u + T(1));
        });
        return;
    }
    if (activation == GELU_ERF) {  // x (1 + erf(x / sqrt 2)) / 2: erf_lanes' within 1.5e-7, std::erf's for doubles
        constexpr double root_half = 0.70710678118654752440;
        each_activation(up, stride, rows, intermediate, [&](V::type x, const float*) {
            return 0.5f * x * (1.0f + erf_lanes(float(root_half) * x));
        }, [&](T x, const T*) { return T(0.5) * x * (T(1) + std::erf(x * T(root_half))); });
        return;
    }
    if (activation == RELU_SQUARED) {
        each_activation(up, stride, rows, intermediate, [&](V::type x, const float*) {
            const V::type r = x > 0.0f ? x : V::type{};
            return r * r;
        }, [&](T x, const T*) { return x > T(0) ? x * x : T(0); });
        return;
    }
    constexpr T root_2_over_pi = T(0.7978845608028654), cubic = T(0.044715);
    const bool gated = activation != GELU_TANH, silu = activation == SILU_GATED;
    each_activation(up, stride, rows, intermediate, [&](V::type x, const float* b) {
        const V::type u = silu ? x : float(root_2_over_pi) * (x + float(cubic) * x * x * x);
        const V::type y = x / (1.0f + exp_lanes((silu ? -1.0f : -2.0f) * u));
        return gated ? y * V::load(b) : y;
    }, [&](T x, const T* b) {
        const T u = silu ? x : root_2_over_pi * (x + cubic * x * x * x);
        const T y = x / (T(1) + std::exp((silu ? T(-1) : T(-2)) * u));
        return gated ? y * *b : y;
    });
}

// Each row's attention output times the sigmoid of its gates (Qwen3.5's, ``stride`` apart in qkv).
template <typename T>
void gate_rows(T* attn, const T* gates, int64_t stride, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gates + r * stride;
        T* a = attn + r * width;
        for (int64_t i = 0; i < width; ++i) a[i] /= T(1) + std::exp(-g[i]);
    }
}

// The first ``width`` values of each row of ``from`` (rows ``from_stride`` apart) into ``to`` (``width`` apart).
template <typename T>
void copy_rows(const T* from, int64_t from_stride, T* to, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) std::copy_n(from + r * from_stride, width, to + r * width);
}

// Each row of x (``width`` values) times the same row of ``by`` (rows ``by_stride`` apart).
template <typename T>
void multiply_rows(T* x, const T* by, int64_t by_stride, int64_t rows, int64_t width) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < width; ++i) x[r * width + i] *= by[r * by_stride + i];
}

template <typename T>
void add_rows(T* x, const T* delta, int64_t count) {
#pragma omp for
    for (int64_t i = 0; i < count; ++i) x[i] += delta[i];
}

// Each value clamped to [-limit, limit].
template <typename T>
void clamp_values(T* x, double limit, int64_t count) {
    const T top = static_cast<T>(limit);
#pragma omp for
    for (int64_t i = 0; i < count; ++i) x[i] = std::clamp(x[i], -top, top);
}

template <typename T>
void scale_values(T* x, double factor, int64_t count) {
    const T f = static_cast<T>(factor);
#pragma omp for
    for (int64_t i = 0; i < count; ++i) x[i] *= f;
}

// Each row's queries (the first q_width values of its qkv row) times the row's scale, before the
// rotation (which a scale commutes with).
template <typename T>
void scale_queries(T* qkv, int64_t qkv_width, int64_t q_width, const T* scales, int64_t rows) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* q = qkv + r * qkv_width;
        for (int64_t i = 0; i < q_width; ++i) q[i] *= scales[r];
    }
}

// One team's intermediates for ``rows`` rows of a layer, each on whole cache lines (vector.h). A
// layer with experts works on its rows' (row, expert) pairs, rows x top_k of them, grouped by expert.
template <typename T>
struct Intermediates {
    T* h;       // [rows, hidden] normed input of a product
    T* qkv;     // [rows, qkv_width]
    T* q;       // [rows, q_width] rotated queries
    T* attn;    // [rows, q_width]
    T* up;      // [rows, up_width]; with experts [pairs, 2 x intermediate], or a shared expert's [rows, 2 x its]
    T* delta;   // [rows, hidden] a product's output, added to x
    T* scratch;  // the products' (product_scratch_size for the widest input)
    // a delta-rule layer's (null elsewhere): its convolution's output [rows, conv width], z [rows, its
    // answers' width], beta's and alpha's logits [rows, heads]; a Mamba2 layer's convolution's output
    T *convolved = nullptr, *z = nullptr, *beta = nullptr, *alpha = nullptr;
    // a Mamba2 beside the attention's (null elsewhere): its input product's output [rows, projection], its answers
    // [rows, inner]
    T *projected = nullptr, *answers = nullptr;
    // experts beside the MLP's (null elsewhere): their router's input [rows, hidden], their output [rows, hidden]
    T *route = nullptr, *beside_out = nullptr;
    // Gemma 3n's (null elsewhere): the active stream [rows, hidden] the layer runs on, Laurel's low rank [rows,
    // rank] and output [rows, hidden], the modalities [rows, streams]
    T *active = nullptr, *low = nullptr, *laurel = nullptr, *modalities = nullptr;
    // a latent attention's (null elsewhere): the queries where they come from a low rank [rows, heads x (nope +
    // rope)], kv_down's output [rows, kv_rank + rope], the keys as the pool keeps them [rows, dim], the heads'
    // values [rows, heads x value]
    T *queries = nullptr, *kv = nullptr, *keys = nullptr, *values = nullptr;
    // with experts: the router's logits [rows, count]; each pair's weight (pair r x top_k + j: row r's
    // j-th choice), expert and place in the grouped order; each expert's first place (count + 1);
    // the pairs' input rows and outputs in that order [pairs, hidden] (once the routed products are
    // done, the shared expert's outputs [rows, hidden] in pair_rows, its gates' logits in logits)
    T *logits, *pair_weights, *pair_rows, *pair_outputs;
    int64_t *pair_experts, *pair_places, *expert_starts;
    T* latent = nullptr;  // a latent mixture's rows in its space [rows, latent], then their routed sum
    int64_t size = 0;  // elements in all

    // ``base`` null: the size alone
    template <typename C>
    Intermediates(const Layer<T, C>& l, int64_t rows, T* base) {
        const int64_t q_width = l.mixed_width(), qkv_width = l.mix_width();
        const int64_t pairs = l.experts == nullptr ? 0 : rows * l.experts->top_k;
        const int64_t shared = l.experts == nullptr ? 0 : l.experts->shared_intermediate;
        auto take = [&](int64_t elements) {
            T* p = base == nullptr ? nullptr : base + size;
            size += whole_lines<T>(elements);
            return p;
        };
        auto take_indices = [&](int64_t count) {
            return reinterpret_cast<int64_t*>(take((count * int64_t(sizeof(int64_t)) + sizeof(T) - 1) / sizeof(T)));
        };
        h = take(rows * l.hidden);
        qkv = take(rows * qkv_width);
        q = take(rows * q_width);
        attn = take(rows * q_width);
        const int64_t experts_inner = l.experts != nullptr && l.experts->intermediate ? l.experts->intermediate : 0;
        up = take(std::max({rows * l.intermediate, pairs * std::max(experts_inner, l.intermediate), rows * shared}) * 2);
        delta = take(rows * l.hidden);
        const int64_t beside = l.mamba_beside == nullptr ? 0 : l.mamba_beside->inner();
        scratch = take(product_scratch_size<T>(std::max(rows, pairs), std::max({l.hidden, q_width, l.intermediate,
                                                                                shared, beside, experts_inner})));
        if (l.mamba != nullptr) convolved = take(rows * l.mamba->conv_width());
        if (l.selective != nullptr) {  // (its convolved inputs, its x_proj's output in ``z``, its time steps in ``beta``)
            convolved = take(rows * l.selective->inner);
            z = take(rows * l.selective->steps_width());
            beta = take(rows * l.selective->inner);
        }
        if (l.mamba_beside != nullptr) {
            const MambaLayer& m = *l.mamba_beside;
            convolved = take(rows * m.conv_width());
            projected = take(rows * m.projection());
            answers = take(rows * m.inner());
        }
        if (l.latent != nullptr) {
            const LatentLayer& m = *l.latent;
            if (m.q_up != nullptr) queries = take(rows * m.queries(l.heads));
            kv = take(rows * (m.kv_rank + m.rope));
            keys = take(rows * l.dim);
            values = take(rows * l.heads * m.value);
        }
        if (l.altup != nullptr) {
            active = take(rows * l.hidden);
            low = take(rows * l.altup->laurel_rank);
            laurel = take(rows * l.hidden);
            modalities = take(rows * l.altup->streams);
        }
        if (l.delta != nullptr) {
            convolved = take(rows * qkv_width);
            z = take(rows * q_width);
            beta = take(rows * l.delta->heads);
            alpha = take(rows * l.delta->heads);
        }
        if (l.experts != nullptr) {
            logits = take(rows * l.experts->count);
            pair_weights = take(pairs);
            pair_rows = take(pairs * l.hidden);
            pair_outputs = take(pairs * l.hidden);
            pair_experts = take_indices(pairs);
            pair_places = take_indices(pairs);
            expert_starts = take_indices(l.experts->count + 1);
            if (l.experts->latent) latent = take(rows * l.experts->latent);
            if (l.experts->beside) {
                route = take(rows * l.hidden);
                beside_out = take(rows * l.hidden);
            }
        }
    }
};

// A latent attention's keys as the pool keeps them, [rotary part | normed latent] a row (kv_down's rows are
// [latent | rotary part]), and each head's rotary part of its query (queries' rows ``q_stride`` apart, a head's
// nope values first) at the start of its place in ``latent_queries`` (a head's dim values), before the latent
// space's part. A task per row.
template <typename T>
void latent_rows(const T* kv, const T* queries, int64_t q_stride, const LatentLayer& m, int64_t rows, int64_t heads,
                 int64_t dim, T* keys, T* latent_queries) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        const T* row = kv + r * (m.kv_rank + m.rope);
        T* key = keys + r * dim;
        std::copy_n(row + m.kv_rank, m.rope, key);
        norm_row<T>(row, static_cast<const T*>(m.kv_norm), nullptr, false, m.eps, key + m.rope, m.kv_rank);
        for (int64_t h = 0; h < heads; ++h)
            std::copy_n(queries + r * q_stride + h * (m.nope + m.rope) + m.nope, m.rope,
                        latent_queries + (r * heads + h) * dim);
    }
}

// Elements of one team's intermediates for ``rows`` rows of a layer (a multiple of whole lines).
template <typename T, typename C>
size_t scratch_size(const Layer<T, C>& l, int64_t rows) {
    return Intermediates<T>(l, rows, nullptr).size;
}

// Each row's top_k experts and their weights (pair r x top_k + j: row r's j-th most probable): the
// softmax of its logits in float32 whatever the model's dtype (as transformers routes, and the torch
// layers), renormalised over the chosen where the model says (``normalize``); chosen by probability
// plus the expert's selection bias where the model has one. A task per row.
template <typename T>
void choose_experts(const T* logits, int64_t rows, const Experts& e, T* pair_weights, int64_t* pair_experts) {
    using R = float;
    const T* bias = static_cast<const T*>(e.selection_bias);
    const T* expert_scales = static_cast<const T*>(e.expert_scales);
    thread_local std::vector<R> probs, scores;
    thread_local std::vector<int64_t> order;
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        const T* l = logits + r * e.count;
        probs.resize(e.count);
        order.resize(e.count);
        R top = R(l[0]), sum = 0, chosen = 0;
        if (e.sigmoid) {  // (a sum of 1: each probability its own)
            for (int64_t i = 0; i < e.count; ++i) probs[i] = R(1) / (R(1) + std::exp(-R(l[i])));
            sum = 1;
        } else {
            for (int64_t i = 1; i < e.count; ++i) top = std::max(top, R(l[i]));
            for (int64_t i = 0; i < e.count; ++i) sum += probs[i] = std::exp(R(l[i]) - top);
        }
        for (int64_t i = 0; i < e.count; ++i) order[i] = i;
        const R* score = probs.data();  // (a row's probabilities, or with a bias their sum with it)
        if (bias != nullptr) {
            scores.resize(e.count);
            for (int64_t i = 0; i < e.count; ++i) scores[i] = probs[i] / sum + R(bias[i]);
            score = scores.data();
        }
        // the highest score first; of equal ones, the lower index (torch.topk's order on the CPU)
        std::partial_sort(order.begin(), order.begin() + e.top_k, order.end(),
                          [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
        for (int64_t j = 0; j < e.top_k; ++j) chosen += probs[order[j]] / sum;
        for (int64_t j = 0; j < e.top_k; ++j) {
            const R weight = probs[order[j]] / sum;
            const R scale = expert_scales != nullptr ? R(expert_scales[order[j]]) : R(1);
            pair_weights[r * e.top_k + j] = T((e.normalize ? weight / chosen : weight) * R(e.routed_scale) * scale);
            pair_experts[r * e.top_k + j] = order[j];
        }
    }
}

// The experts' output for the rows of h [rows, hidden] into ``out`` [rows, hidden]: each routed
// expert's products once over all the rows routed to it (its pairs gathered in a run), the rows
// taking their experts' outputs weighted, in the order of their choices, then the shared expert's
// (Experts says how). Routed on ``route`` (null: h). The team shares each product, as a dense MLP's.
template <typename T, typename C>
void expert_phases(const T* h, const Layer<T, C>& l, int64_t rows, const Intermediates<T>& b, T* out,
                   int64_t panel_from, const T* route = nullptr) {
    const Experts& e = *l.experts;
    const int64_t hidden = l.hidden, inner = e.intermediate ? e.intermediate : l.intermediate, pairs = rows * e.top_k;
    const int64_t width = e.latent ? e.latent : hidden;  // the routed experts' rows
    const int64_t up_width = ungated(e.activation) ? inner : 2 * inner;
    const T *router_bias = static_cast<const T*>(e.router_bias), *gate_up_bias = static_cast<const T*>(e.gate_up_bias),
            *down_bias = static_cast<const T*>(e.down_bias), *no_bias = nullptr;
    // expert i's row of a bias stack, or null
    const auto row_of = [](const T* biases, int64_t i, int64_t width) { return biases ? biases + i * width : nullptr; };
    product(route != nullptr ? route : h, hidden, rows, *e.router, router_bias, hidden, b.logits, e.count, b.scratch,
            panel_from);
    choose_experts(b.logits, rows, e, b.pair_weights, b.pair_experts);
    const T* routed = h;
    if (e.latent) {
        product(h, hidden, rows, *e.latent_down, no_bias, hidden, b.latent, width, b.scratch, panel_from);
        routed = b.latent;
    }
#pragma omp single
    {  // the pairs grouped by expert, in pair order within each (a counting sort)
        std::fill_n(b.expert_starts, e.count + 1, int64_t(0));
        for (int64_t p = 0; p < pairs; ++p) ++b.expert_starts[b.pair_experts[p] + 1];
        for (int64_t i = 0; i < e.count; ++i) b.expert_starts[i + 1] += b.expert_starts[i];
        std::vector<int64_t> next(b.expert_starts, b.expert_starts + e.count);
        for (int64_t p = 0; p < pairs; ++p) b.pair_places[p] = next[b.pair_experts[p]]++;
    }
#pragma omp for
    for (int64_t p = 0; p < pairs; ++p) {
        const T *row = routed + p / e.top_k * width, weight = b.pair_weights[p];
        T* pair_row = b.pair_rows + b.pair_places[p] * width;
        if (e.weights_inputs)
            for (int64_t c = 0; c < width; ++c) pair_row[c] = weight * row[c];
        else
            std::copy_n(row, width, pair_row);
    }
    for (int64_t i = 0; i < e.count; ++i) {
        const int64_t first = b.expert_starts[i], count = b.expert_starts[i + 1] - first;
        if (count > 0)
            product(b.pair_rows + first * width, width, count, e.gate_up[i], row_of(gate_up_bias, i, up_width), width,
                    b.up + first * up_width, up_width, b.scratch, panel_from);
    }
    activate_rows(b.up, up_width, e.activation, pairs, inner, e.alpha, e.limit);
    for (int64_t i = 0; i < e.count; ++i) {
        const int64_t first = b.expert_starts[i], count = b.expert_starts[i + 1] - first;
        if (count > 0)
            product(b.up + first * up_width, up_width, count, e.down[i], row_of(down_bias, i, width), inner,
                    b.pair_outputs + first * width, width, b.scratch, panel_from);
    }
    const bool shares = e.shared_gate_up != nullptr;
    if (shares) {  // the routed products' inputs and activations are spent: their room takes the shared expert's
        const int64_t shared = e.shared_intermediate;
        const int64_t activation = e.activation == RELU_SQUARED ? RELU_SQUARED : SILU_GATED;
        const int64_t stride = ungated(activation) ? shared : 2 * shared;
        product(h, hidden, rows, *e.shared_gate_up, no_bias, hidden, b.up, stride, b.scratch, panel_from);
        activate_rows(b.up, stride, activation, rows, shared);
        product(b.up, stride, rows, *e.shared_down, no_bias, shared, b.pair_rows, hidden, b.scratch, panel_from);
        if (e.shared_gate != nullptr)
            product(h, hidden, rows, *e.shared_gate, no_bias, hidden, b.logits, int64_t(1), b.scratch, panel_from);
    }
    T* sum = e.latent ? b.latent : out;  // (a latent mixture's rows in its space are spent)
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* y = sum + r * width;
        std::fill_n(y, width, T(0));
        for (int64_t j = 0; j < e.top_k; ++j) {
            const int64_t p = r * e.top_k + j;
            const T weight = e.weights_inputs ? T(1) : b.pair_weights[p];
            const T* expert_out = b.pair_outputs + b.pair_places[p] * width;
            for (int64_t c = 0; c < width; ++c) y[c] += weight * expert_out[c];
        }
    }
    if (e.latent) product(b.latent, width, rows, *e.latent_up, no_bias, width, out, hidden, b.scratch, panel_from);
    if (shares) {
#pragma omp for
        for (int64_t r = 0; r < rows; ++r) {
            const T gate = e.shared_gate == nullptr ? T(1) : T(1) / (T(1) + std::exp(-b.logits[r]));
            const T weight = T(e.shared_scale) * gate;
            const T* shared_out = b.pair_rows + r * hidden;
            T* y = out + r * hidden;
            for (int64_t c = 0; c < hidden; ++c) y[c] += weight * shared_out[c];
        }
    }
}

// A Mamba2 layer's rows between its products (mamba_scan.h): ``projected`` [rows, m.projection()] its input
// product's, its answers into ``answers`` [rows, m.inner()], the step's sequences' states read and written in
// their slots.
template <typename T>
void mamba_rows(const MambaLayer& m, const T* projected, int64_t rows, const Step<T>& s, T* convolved, T* answers) {
    const Mamba2Mixer<T> mixer{projected, m.projection(), static_cast<const T*>(m.conv),
                               static_cast<const T*>(m.conv_bias), static_cast<T*>(m.conv_states),
                               static_cast<const T*>(m.dt_bias), static_cast<const T*>(m.decay),
                               static_cast<const T*>(m.skip), static_cast<const T*>(m.norm), static_cast<T*>(m.states),
                               convolved, answers, s.state_slots, s.lens, rows, m.heads, m.head_dim, m.state_size,
                               m.groups, m.taps, m.eps};
    mixer.run();
}

// Each row's modalities [rows, streams] (AltUpLayer): tanh of the router over the row (``in``) normed and scaled by
// 1 / hidden, through ``normed`` [rows, hidden]. ``multiply`` as layer_phases' (a layer's product).
template <typename T, typename Multiply>
void altup_modalities(const T* in, const AltUpLayer& a, int64_t rows, int64_t hidden, double eps, T* normed,
                      T* modalities, Multiply multiply) {
    norm_rows<T>(const_cast<T*>(in), nullptr, static_cast<const T*>(a.router_norm), nullptr, false, eps, normed, rows,
                 hidden);
    scale_values(normed, 1.0 / double(hidden), rows * hidden);
    multiply(normed, hidden, hidden, a.router, a.streams, modalities);
#pragma omp for
    for (int64_t i = 0; i < rows * a.streams; ++i) modalities[i] = std::tanh(modalities[i]);
}

// In place over each row's streams (rows ``streams`` x ``hidden`` apart): stream i plus the mix of all of them by
// the row's coefficients (predict_coefs over its modalities: row i of a streams x streams matrix).
template <typename T>
void altup_predict(T* streams, const AltUpLayer& a, const T* modalities, int64_t rows, int64_t hidden) {
    const int64_t n = a.streams;
    const T* weights = static_cast<const T*>(a.predict_coefs);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T mix[MOST_STREAMS * MOST_STREAMS], v[MOST_STREAMS];
        for (int64_t k = 0; k < n * n; ++k) {
            T c = 0;
            for (int64_t j = 0; j < n; ++j) c += modalities[r * n + j] * weights[k * n + j];
            mix[k] = c;
        }
        T* row = streams + r * n * hidden;
        for (int64_t h = 0; h < hidden; ++h) {
            for (int64_t j = 0; j < n; ++j) v[j] = row[j * hidden + h];
            for (int64_t i = 0; i < n; ++i) {
                T sum = v[i];
                for (int64_t j = 0; j < n; ++j) sum += mix[i * n + j] * v[j];
                row[i * hidden + h] = sum;
            }
        }
    }
}

// In place over each row's predicted streams: each plus the innovation (``activated`` less the active
// prediction) times its coefficient (correct_coefs over the activated row's modalities, + 1).
template <typename T>
void altup_correct(T* streams, const AltUpLayer& a, const T* activated, const T* modalities, int64_t rows,
                   int64_t hidden) {
    const int64_t n = a.streams;
    const T* weights = static_cast<const T*>(a.correct_coefs);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T coefs[MOST_STREAMS];
        for (int64_t i = 0; i < n; ++i) {
            T c = 1;
            for (int64_t j = 0; j < n; ++j) c += modalities[r * n + j] * weights[i * n + j];
            coefs[i] = c;
        }
        T* row = streams + r * n * hidden;
        const T* x = activated + r * hidden;
        for (int64_t h = 0; h < hidden; ++h) {
            const T innovation = x[h] - row[h];
            for (int64_t i = 0; i < n; ++i) row[i * hidden + h] += coefs[i] * innovation;
        }
    }
}

// Gemma 3n's sparse MLP gate, in place over the first ``width`` values of each row (``stride`` apart): less its
// mean plus ``stds`` (population) standard deviations, at least 0; the sums in T as torch's are.
template <typename T>
void cut_gates(T* up, int64_t stride, int64_t rows, int64_t width, double stds) {
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        T* g = up + r * stride;
        T mean = 0, squares = 0;
        for (int64_t i = 0; i < width; ++i) mean += g[i];
        mean /= T(width);
        for (int64_t i = 0; i < width; ++i) squares += (g[i] - mean) * (g[i] - mean);
        const T cutoff = mean + std::sqrt(squares / T(width)) * T(stds);
        for (int64_t i = 0; i < width; ++i) g[i] = std::max(g[i] - cutoff, T(0));
    }
}

// One layer over the step's rows, its work shared among the threads of the enclosing team: every
// phase ends at its work-sharing loop's barrier. ``scratch``: scratch_size(l, s.rows) elements, from
// a cache line's start.
template <typename T, typename C>
void layer_phases(T* x, const Layer<T, C>& l, const Step<T>& s, T* scratch, int64_t panel_from) {
    const int64_t rows = s.rows, hidden = l.hidden, inter = l.intermediate;
    const int64_t up_width = ungated(l.activation) ? inter : 2 * inter;
    const int64_t q_width = l.heads * l.dim, kv_width = l.kv_heads * l.dim, qkv_width = l.mix_width();
    const int64_t gate_width = l.gated ? q_width : 0;  // (the gates between the queries and the keys)
    const Intermediates<T> buffers(l, rows, scratch);
    T *h = buffers.h, *qkv = buffers.qkv, *q = buffers.q, *attn = buffers.attn, *up = buffers.up;
    T* delta = buffers.delta;
    const bool rotary = s.rotary_dim > 0 && l.rotates;  // else the queries are read from qkv as they are
    const bool scales_residuals = l.residual_scale != 1.0;
    // y [rows, out] = a [rows, in] w^T + b, a's rows ``stride`` apart
    auto multiply = [&](const T* a, int64_t stride, int64_t in, const Weights* w, const T* b, int64_t out, T* y) {
        product(a, stride, rows, *w, b, in, y, out, buffers.scratch, panel_from);
    };
    auto unbiased = [&](const T* a, int64_t stride, int64_t in, const Weights* w, int64_t out, T* y) {
        multiply(a, stride, in, w, nullptr, out, y);
    };
    T* const streams = x;  // Gemma 3n's [rows, streams x hidden]: the layer runs on the active stream's prediction
    if (l.altup != nullptr) {
        const AltUpLayer& a = *l.altup;
        copy_rows(streams, a.streams * hidden, buffers.active, rows, hidden);
        altup_modalities(buffers.active, a, rows, hidden, l.eps, h, buffers.modalities, unbiased);
        altup_predict(streams, a, buffers.modalities, rows, hidden);
        copy_rows(streams, a.streams * hidden, buffers.active, rows, hidden);
        x = buffers.active;
    }
    const T* attn_in = x;  // (OLMo's attention reads the residual stream as it is)
    if (l.input_norm != nullptr) {
        norm_rows<T>(x, nullptr, l.input_norm, l.input_norm_bias, l.layer_norm, l.eps, h, rows, hidden);
        attn_in = h;
    }
    if (l.altup != nullptr) {  // Laurel, beside the attention: its low-rank products of the normed input, normed, + it
        const AltUpLayer& a = *l.altup;
        multiply(h, hidden, hidden, a.laurel_left, nullptr, a.laurel_rank, buffers.low);
        multiply(buffers.low, a.laurel_rank, a.laurel_rank, a.laurel_right, nullptr, hidden, buffers.laurel);
        norm_rows<T>(buffers.laurel, nullptr, static_cast<const T*>(a.laurel_norm), nullptr, false, l.eps,
                     buffers.laurel, rows, hidden);
        add_rows(buffers.laurel, h, rows * hidden);
    }
    if (l.conv != nullptr) {  // LFM2's short convolution
        multiply(attn_in, hidden, hidden, l.qkv, l.qkv_bias, 3 * hidden, qkv);
        convolve_rows(qkv, hidden, l.conv, l.conv_bias, l.conv_taps, l.conv_cache, s.slots, s.tables, s.max_blocks,
                      s.lens, s.block_size, rows, attn);
        multiply(attn, hidden, hidden, l.out, l.out_bias, hidden, delta);
    } else if (l.delta != nullptr) {  // Qwen3.5's delta rule
        const DeltaLayer& d = *l.delta;
        const int64_t answers = l.mixed_width();
        multiply(attn_in, hidden, hidden, l.qkv, nullptr, qkv_width, qkv);
        multiply(attn_in, hidden, hidden, d.z, nullptr, answers, buffers.z);
        multiply(attn_in, hidden, hidden, d.beta, nullptr, d.heads, buffers.beta);
        multiply(attn_in, hidden, hidden, d.alpha, nullptr, d.heads, buffers.alpha);
        const DeltaMixer<T> mixer{qkv, static_cast<const T*>(d.conv), static_cast<T*>(d.conv_states), buffers.alpha,
                                  buffers.beta, static_cast<const T*>(d.dt_bias), static_cast<const T*>(d.decay_rate),
                                  static_cast<T*>(d.states), buffers.z, static_cast<const T*>(d.norm),
                                  buffers.convolved, attn, s.state_slots, s.lens, rows, d.key_heads, d.heads,
                                  d.key_dim, d.value_dim, d.taps, d.grouped, d.eps};
        mixer.run();
        multiply(attn, answers, answers, l.out, nullptr, hidden, delta);
    } else if (l.selective != nullptr) {  // Mamba's selective scan (SelectiveLayer)
        const SelectiveLayer& m = *l.selective;
        const int64_t inner = m.inner, width = m.steps_width();
        T *steps = buffers.z, *dt = buffers.beta;
        multiply(attn_in, hidden, hidden, l.qkv, l.qkv_bias, 2 * inner, qkv);
        convolve_runs(qkv, 2 * inner, static_cast<const T*>(m.conv), static_cast<const T*>(m.conv_bias),
                      static_cast<T*>(m.conv_states), buffers.convolved, s.state_slots, s.lens, rows, inner, m.taps);
        multiply(buffers.convolved, inner, inner, m.x_proj, nullptr, width, steps);
        if (m.normed) {  // the time step's low rank, B and C, each normed (by its own weights, where it has them)
            const T* none = nullptr;
            norm_spans(steps, width, rows, 1, 0, m.rank, m.rank, static_cast<const T*>(m.dt_norm), none, m.eps);
            norm_spans(steps + m.rank, width, rows, 1, 1, m.state_size, m.state_size, static_cast<const T*>(m.b_norm),
                       static_cast<const T*>(m.c_norm), m.eps);
        }
        multiply(steps, width, m.rank, m.dt_proj, static_cast<const T*>(m.dt_bias), inner, dt);
#pragma omp for
        for (int64_t i = 0; i < rows * inner; ++i) dt[i] = softplus(dt[i]);
        const SelectiveScan<T> scan{buffers.convolved, dt, steps, width, m.rank, static_cast<const T*>(m.decay),
                                    static_cast<const T*>(m.skip), static_cast<T*>(m.states), attn, s.state_slots,
                                    s.lens, rows, inner, m.state_size};
        scan.run();
#pragma omp for
        for (int64_t r = 0; r < rows; ++r)  // gated by SiLU(z)
            for (int64_t i = 0; i < inner; ++i) attn[r * inner + i] *= silu(qkv[r * 2 * inner + inner + i]);
        multiply(attn, inner, inner, l.out, l.out_bias, hidden, delta);
    } else if (l.mamba != nullptr) {  // Granite 4's Mamba2
        const int64_t answers = l.mixed_width();
        multiply(attn_in, hidden, hidden, l.qkv, l.qkv_bias, qkv_width, qkv);
        mamba_rows(*l.mamba, qkv, rows, s, buffers.convolved, attn);
        multiply(attn, answers, answers, l.out, l.out_bias, hidden, delta);
    } else if (l.latent != nullptr) {  // DeepSeek's latent attention (LatentLayer)
        const LatentLayer& m = *l.latent;
        const int64_t queries_width = m.queries(l.heads), values_width = l.heads * m.value;
        T* queries = qkv;
        if (m.q_up != nullptr) {
            multiply(attn_in, hidden, hidden, l.qkv, nullptr, m.q_rank, qkv);
            norm_rows<T>(qkv, nullptr, static_cast<const T*>(m.q_norm), nullptr, false, m.eps, qkv, rows, m.q_rank);
            queries = buffers.queries;
            multiply(qkv, m.q_rank, m.q_rank, m.q_up, nullptr, queries_width, queries);
        } else {
            multiply(attn_in, hidden, hidden, l.qkv, nullptr, queries_width, qkv);
        }
        multiply(attn_in, hidden, hidden, m.kv_down, nullptr, m.kv_rank + m.rope, buffers.kv);
        // the queries in the pool's space, before their rotation, in attn: a head's rotary part, then its nope
        // values through its k_up matrix
        latent_rows(buffers.kv, queries, queries_width, m, rows, l.heads, l.dim, buffers.keys, attn);
        const T* no_bias = nullptr;
        for (int64_t h = 0; h < l.heads; ++h)
            product(queries + h * (m.nope + m.rope), queries_width, rows, head_weights<T>(*m.k_up, h, m.kv_rank, m.nope),
                    no_bias, m.nope, attn + h * l.dim + m.rope, q_width, buffers.scratch, panel_from);
        if (s.query_scales != nullptr) scale_queries(attn, q_width, q_width, s.query_scales, rows);  // (Mistral 4's)
        rotate_and_store_rows(attn, q_width, buffers.keys, l.dim, buffers.keys, l.dim, s.cos, s.sin, s.rotary_dim,
                              s.slots, rows, l.k_cache, l.v_cache, q, l.heads, int64_t(1), l.dim);
        decode_attention_rows(q, q_width, l.k_cache, l.v_cache, s.tables, s.max_blocks, s.lens, attn, q_width, rows,
                              l.heads, int64_t(1), l.dim, s.block_size, l.window, l.scale, l.softcap, l.sinks);
        for (int64_t h = 0; h < l.heads; ++h)  // each head's weighted latents (past its rotary part) to its values
            product(attn + h * l.dim + m.rope, q_width, rows, head_weights<T>(*m.v_up, h, m.value, m.kv_rank), no_bias,
                    m.kv_rank, buffers.values + h * m.value, values_width, buffers.scratch, panel_from);
        multiply(buffers.values, values_width, values_width, l.out, l.out_bias, hidden, delta);
    } else {
        T* keys = qkv + q_width + gate_width;
        const int64_t stored = l.stored_kv_heads();
        multiply(attn_in, hidden, hidden, l.qkv, l.qkv_bias, qkv_width, qkv);
        if (l.clip_qkv > 0) clamp_values(qkv, l.clip_qkv, rows * qkv_width);  // (OLMo 1.7's, before anything else)
        // the values: after the keys, or (values_are_keys) a copy of the keys before their norm, in attn until
        // they are stored (the attention's output is written after)
        T* values = keys + kv_width;
        int64_t values_stride = qkv_width;
        if (l.values_are_keys) {
            copy_rows(keys, qkv_width, attn, rows, kv_width);
            values = attn, values_stride = kv_width;
        }
        if (l.value_norm && stored > 0)
            norm_spans<T>(values, values_stride, rows, stored, 0, l.dim, l.dim, nullptr, nullptr, l.eps);
        const bool norm_rotated = rotary && l.norms_after_rotation;  // (rotated here, normed, then stored as they are)
        if (l.q_norm != nullptr && l.norms_across_heads) {
            norm_spans(qkv, qkv_width, rows, 1, 1, q_width, kv_width, l.q_norm, l.k_norm, l.eps);
        } else if (l.q_norm != nullptr && l.gated) {  // (the gates between: the queries', then the keys' spans)
            norm_spans(qkv, qkv_width, rows, l.heads, 0, l.dim, l.dim, l.q_norm, l.k_norm, l.eps);
            norm_spans(keys, qkv_width, rows, 0, l.kv_heads, l.dim, l.dim, l.q_norm, l.k_norm, l.eps);
        } else if (l.q_norm != nullptr && !norm_rotated) {
            norm_spans(qkv, qkv_width, rows, l.heads, stored, l.dim, l.dim, l.q_norm, l.k_norm, l.eps,
                       l.head_layer_norms != 0);
        }
        if (s.query_scales != nullptr && !l.unscaled_queries)
            scale_queries(qkv, qkv_width, q_width, s.query_scales, rows);
        const T *cos = l.window_angles ? s.window_cos : s.cos, *sin = l.window_angles ? s.window_sin : s.sin;
        const int64_t rotary_dim = l.window_angles ? s.window_rotary_dim : s.rotary_dim;
        if (norm_rotated) {  // (the keys follow the queries in qkv)
            rotate_rows(qkv, qkv_width, cos, sin, rotary_dim, rows, l.heads + stored, l.dim);
            norm_spans(qkv, qkv_width, rows, l.heads, stored, l.dim, l.dim, l.q_norm, l.k_norm, l.eps);
        }
        const bool turns = rotary && !norm_rotated;  // (as it stores the keys; the queries then read from q)
        rotate_and_store_rows(qkv, qkv_width, keys, qkv_width, values, values_stride, cos, sin, turns ? rotary_dim : 0,
                              s.slots, rows, l.k_cache, l.v_cache, turns ? q : nullptr, l.heads, stored, l.dim);
        decode_attention_rows(turns ? q : qkv, turns ? q_width : qkv_width, l.k_cache, l.v_cache, s.tables,
                              s.max_blocks, s.lens, attn, q_width, rows, l.heads, l.kv_heads, l.dim, s.block_size,
                              l.window, l.scale, l.softcap, l.sinks, l.slopes);
        if (l.gated) gate_rows(attn, qkv + q_width, qkv_width, rows, q_width);
        multiply(attn, q_width, q_width, l.out, l.out_bias, hidden, delta);
    }
    if (l.mamba_beside != nullptr) {  // its answers, through h (the input, read by now), added to the attention's
        const MambaLayer& m = *l.mamba_beside;
        multiply(attn_in, hidden, hidden, m.in, nullptr, m.projection(), buffers.projected);
        mamba_rows(m, buffers.projected, rows, s, buffers.convolved, buffers.answers);
        multiply(buffers.answers, m.inner(), m.inner(), m.out, nullptr, hidden, h);
        add_rows(delta, h, rows * hidden);
    }
    if (l.attn_out_norm != nullptr) norm_rows<T>(delta, nullptr, l.attn_out_norm, nullptr, false, l.eps, delta, rows, hidden);
    if (scales_residuals) scale_values(delta, l.residual_scale, rows * hidden);
    if (l.up == nullptr && l.experts == nullptr) {  // (no MLP)
        add_rows(x, delta, rows * hidden);
        return;
    }
    const T* mlp_in = x;  // (and so does its MLP)
    if (l.altup != nullptr) {  // Laurel's output beside the attention's, their sum with the input times 1 / sqrt(2)
        add_rows(delta, buffers.laurel, rows * hidden);
        add_rows(x, delta, rows * hidden);
        scale_values(x, std::sqrt(0.5), rows * hidden);
        norm_rows<T>(x, nullptr, l.post_norm, nullptr, false, l.eps, h, rows, hidden);
        mlp_in = h;
    } else if (l.post_norm != nullptr && l.parallel) {  // the MLP beside the attention, on a norm of its own of x
        norm_rows(x, static_cast<const T*>(nullptr), l.post_norm, l.post_norm_bias, l.layer_norm, l.eps, h, rows,
                  hidden);
        add_rows(x, delta, rows * hidden);
        mlp_in = h;
    } else if (l.post_norm != nullptr) {
        norm_rows(x, delta, l.post_norm, l.post_norm_bias, l.layer_norm, l.eps, h, rows, hidden);
        mlp_in = h;
    } else {
        add_rows(x, delta, rows * hidden);
        if (l.parallel) mlp_in = attn_in;  // (the input norm's output, which the attention read)
    }
    if (l.experts != nullptr && !l.experts->beside) {
        expert_phases(mlp_in, l, rows, buffers, delta, panel_from);
    } else {
        multiply(mlp_in, hidden, hidden, l.up, l.up_bias, up_width, up);
        if (l.altup != nullptr && l.altup->sparse) cut_gates(up, up_width, rows, inter, l.altup->cutoff_stds);
        activate_rows(up, up_width, l.activation, rows, inter, 0, 0, l.xielu);
        multiply(up, up_width, inter, l.down, l.down_bias, hidden, delta);  // act(gate) x up
    }
    if (l.experts != nullptr && l.experts->beside) {  // the experts beside the MLP, over x (Experts says how)
        const Experts& e = *l.experts;
        const auto in_type = [](const void* p) { return static_cast<const T*>(p); };
        norm_rows<T>(delta, nullptr, in_type(e.dense_norm), nullptr, false, l.eps, delta, rows, hidden);
        norm_rows<T>(x, nullptr, in_type(e.route_norm), nullptr, false, l.eps, buffers.route, rows, hidden);
        norm_rows<T>(x, nullptr, in_type(e.pre_norm), nullptr, false, l.eps, h, rows, hidden);  // (h is spent)
        expert_phases(h, l, rows, buffers, buffers.beside_out, panel_from, buffers.route);
        norm_rows<T>(buffers.beside_out, nullptr, in_type(e.post_norm), nullptr, false, l.eps, buffers.beside_out, rows,
                     hidden);
        add_rows(delta, buffers.beside_out, rows * hidden);
    }
    if (l.mlp_out_norm != nullptr) norm_rows<T>(delta, nullptr, l.mlp_out_norm, nullptr, false, l.eps, delta, rows, hidden);
    if (scales_residuals) scale_values(delta, l.residual_scale, rows * hidden);
    add_rows(x, delta, rows * hidden);
    const T* gate_in = x;  // (the per-layer input's gate's)
    if (l.altup != nullptr) {  // the streams corrected; the per-layer input gated by the active one, times its scale
        const AltUpLayer& a = *l.altup;
        altup_modalities(x, a, rows, hidden, l.eps, h, buffers.modalities, unbiased);
        altup_correct(streams, a, x, buffers.modalities, rows, hidden);
        copy_rows(streams, a.streams * hidden, h, rows, hidden);
        if (a.correct_scale != nullptr) multiply_rows(h, static_cast<const T*>(a.correct_scale), 0, rows, hidden);
        gate_in = h;
    }
    if (l.per_layer_gate != nullptr) {  // Gemma 4's and 3n's per-layer input, through up (the MLP's is spent)
        const int64_t width = l.per_layer_width;
        multiply(gate_in, hidden, hidden, l.per_layer_gate, nullptr, width, up);
        activate_rows(up, width, GELU_TANH, rows, width);
        multiply_rows(up, s.per_layer_inputs + l.per_layer_offset, s.per_layer_stride, rows, width);
        multiply(up, width, width, l.per_layer_out, nullptr, hidden, delta);
        norm_rows<T>(delta, nullptr, l.per_layer_norm, nullptr, false, l.eps, delta, rows, hidden);
        if (l.altup != nullptr) {  // (added to the streams but the first)
            const int64_t n = l.altup->streams;
#pragma omp for
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t i = 1; i < n; ++i)
                    for (int64_t k = 0; k < hidden; ++k) streams[(r * n + i) * hidden + k] += delta[r * hidden + k];
            return;
        }
        add_rows(x, delta, rows * hidden);
    }
    if (l.layer_scale != 1.0) scale_values(x, l.layer_scale, rows * hidden);
}

// Elements of the output layer's scratch for ``sampled`` rows: the rows, then the product's panels.
template <typename T>
size_t head_scratch_size(int64_t sampled, int64_t hidden, int64_t streams) {
    return whole_lines<T>(sampled * hidden) * (streams > 1 ? 3 : 1) + product_scratch_size<T>(sampled, hidden);
}

// Root mean square of ``width`` values (at least sqrt(floor), squared: transformers' clamp of Gemma 3n's).
template <typename T>
T root_mean_square(const T* x, int64_t width, T floor = 0) {
    T squares = 0;
    for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
    return std::sqrt(std::max(squares / T(width), floor));
}

// Gemma 3n's streams of the sampled rows of x (``row_width`` apart) merged into ``rows`` [sampled, hidden] (Head),
// through ``gathered`` and ``back`` [sampled, hidden] each.
template <typename T>
void merge_streams(const T* x, int64_t hidden, int64_t row_width, const Head<T>& head, const Step<T>& s, T* rows,
                   T* gathered, T* back, T* product_scratch, int64_t panel_from) {
    const T* no_bias = nullptr;
#pragma omp for
    for (int64_t r = 0; r < s.sampled; ++r) std::copy_n(x + s.samples[r] * row_width, hidden, rows + r * hidden);
    for (int64_t i = 1; i < head.streams; ++i) {
#pragma omp for
        for (int64_t r = 0; r < s.sampled; ++r)
            std::copy_n(x + s.samples[r] * row_width + i * hidden, hidden, gathered + r * hidden);
        product(gathered, hidden, s.sampled, head.unembed[i - 1], no_bias, hidden, back, hidden, product_scratch,
                panel_from);
#pragma omp for
        for (int64_t r = 0; r < s.sampled; ++r) {
            const T* b = back + r * hidden;
            const T factor = root_mean_square(x + s.samples[r] * row_width, hidden) /
                             root_mean_square(b, hidden, T(1e-5));
            for (int64_t k = 0; k < hidden; ++k) rows[r * hidden + k] += b[k] * factor;
        }
    }
    scale_values(rows, 1.0 / double(head.streams), s.sampled * hidden);
}

// The output layer over the step's sampled rows of x, into ``logits`` [sampled, vocab], its work
// shared among the threads of the enclosing team. In the layers' parallel region rather than after
// it as torch operators and a product of its own: those ran cold after the layers had streamed the
// weights (the norm of one row 0.13-0.19 ms, 11 us warm), and the product's region woke a worker
// that had gone to sleep (one stream 84.0 -> 86.3 tok/s; docs/benchmarks.md, "A few rows, one
// weight row at a time").
template <typename T>
void head_phases(const T* x, int64_t hidden, const Head<T>& head, const Step<T>& s, T* scratch, T* logits,
                 int64_t panel_from) {
    const int64_t line = whole_lines<T>(s.sampled * hidden);
    T* rows = scratch;
    T* product_scratch = scratch + line * (head.streams > 1 ? 3 : 1);
    if (head.streams > 1) {
        merge_streams(x, hidden, hidden * head.streams, head, s, rows, scratch + line, scratch + 2 * line,
                      product_scratch, panel_from);
    } else {
#pragma omp for
        for (int64_t r = 0; r < s.sampled; ++r) std::copy_n(x + s.samples[r] * hidden, hidden, rows + r * hidden);
    }
    norm_rows<T>(rows, nullptr, head.norm, head.norm_bias, head.layer_norm, head.eps, rows, s.sampled, hidden);
    product(rows, hidden, s.sampled, *head.weight, head.bias, hidden, logits, head.vocab, product_scratch, panel_from);
}

// The step's rows [first, end) as a step of their own.
template <typename T>
Step<T> row_range(const Step<T>& s, int64_t first, int64_t end) {
    Step<T> part = s;
    part.cos += first * s.rotary_dim;
    part.sin += first * s.rotary_dim;
    if (s.window_cos != nullptr) {
        part.window_cos += first * s.window_rotary_dim;
        part.window_sin += first * s.window_rotary_dim;
    }
    if (s.per_layer_inputs != nullptr) part.per_layer_inputs += first * s.per_layer_stride;
    if (s.query_scales != nullptr) part.query_scales += first;
    part.slots += first;
    if (s.state_slots != nullptr) part.state_slots += first;
    part.tables += first * s.max_blocks;
    part.lens += first;
    part.rows = end - first;
    return part;
}

// For the time of a step whose threads carry their own rows, each thread stays on the core it is
// on (where no other thread of the team claimed that core first), then may move again. Left to
// move, on cores that other processes share, the threads changed cores as the kernel balanced the
// runnable tasks, and each move left a thread's weights and panels in the other core's cache: a
// 64-row forward beside one busy process took 125-142 ms, against 88-93 staying (quiet and beside
// two busy processes level; docs/benchmarks.md, "Wide panels"). The kernel's choice of cores at
// the step's start stands: a thread is not sent to a core that others keep busy.
class StayOnThisCore {
#ifdef __linux__
    // The cores a thread stays on now, across every team in the process: two engines' threads
    // never stay on one core together.
    static inline std::atomic<bool> claimed[CPU_SETSIZE];
    cpu_set_t before_;
    int cpu_ = -1;

  public:
    StayOnThisCore() {
        const int cpu = sched_getcpu();
        if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof before_, &before_) != 0 ||
            CPU_COUNT(&before_) < 2 || claimed[cpu].exchange(true))
            return;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        if (sched_setaffinity(0, sizeof one, &one) == 0)
            cpu_ = cpu;
        else
            claimed[cpu] = false;
    }
    ~StayOnThisCore() {
        if (cpu_ < 0) return;
        if (sched_setaffinity(0, sizeof before_, &before_) != 0) {
            // The cores it had are gone (a container's CPU set shrank during the step): any the
            // kernel still allows, rather than staying on this one.
            cpu_set_t any;
            CPU_ZERO(&any);
            for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &any);
            sched_setaffinity(0, sizeof any, &any);
        }
        claimed[cpu_] = false;
    }
#else
  public:
    StayOnThisCore() {}
#endif
    StayOnThisCore(const StayOnThisCore&) = delete;
    StayOnThisCore& operator=(const StayOnThisCore&) = delete;
};

// The rows one thread carries through the layers now, where threads carry their own: [first, end)
// from ``layer`` on (the layer in flight; the layer count when none is). Another thread may take
// the later rows for the layers after the one in flight (decoder_layers): it lowers ``end``, which
// the carrier reads at each layer's start, and waits for ``progress`` to pass the layer in flight.
struct alignas(64) Carried {
    std::mutex lock;
    int64_t first = 0, end = 0, layer = 0;  // under ``lock``
    std::atomic<int64_t> progress{0};       // layers this thread has finished, ever (written under ``lock``)
};

// Every layer over the step's rows, then the output layer over its sampled rows. The rows go
// through the layers in passes of at most ``pass_rows``, one pass after another: a pass's rows read
// the K/V that earlier passes wrote, as a later prefill chunk reads an earlier one's, and the
// intermediates stay the size of a pass whatever the step's (a prefill of 64 prompts is 1344 rows).
// With ``s.shares`` (decoder_layer.py chooses: enough rows per thread), each thread carries its
// own share of the rows through all the layers, alone: one barrier per step instead of ten per
// layer. On cores that other processes share, a thread the kernel parks then holds up only its own
// rows, where each phase's barrier held up its partner's too (beside one busy process the phases'
// two threads got one core between them; a 64-row step took 162 ms shared against 121 split, quiet
// 81 against 74; docs/benchmarks.md "Threads that carry their own rows"). The shares end where
// sequences start: a row reads the K/V its sequence's earlier rows write in the same pass.
//
// A thread whose share is done takes the later half of the rows another still carries in its last
// pass (from a sequence's start, at least ``take_rows`` each side), for the layers after the one in
// flight, and carries those; it may be taken from in turn. Otherwise it would wait at the barrier
// for a partner that the kernel parked (beside a busy process, or the server's own threads), with
// every row of the partner's share left to it: a 64-row step of the 360M F32 on a Zen 3 beside a
// process busy a quarter of the time took 423-428 ms taking, 449-470 not, 513-518 on the team
// (docs/benchmarks-history.md, "Threads that take each other's rows"). Only a last pass gives rows
// away: a later pass reads the K/V its earlier ones write, layer by layer.
template <typename T, typename C>
void decoder_layers(T* x, const Layer<T, C>* layers, int64_t count, Step<T>& s, const Head<T>& head,
                    T* logits) {
    const bool split = s.shares != nullptr;
    const int parts = split ? int(s.parts) : 1;
    const int64_t panel_from = s.panel_from, hidden = layers[0].hidden, row_width = hidden * head.streams;
    int64_t widest = 0;  // the most rows a share holds
    for (int t = 0; t < parts; ++t) widest = std::max(widest, split ? s.shares[t + 1] - s.shares[t] : s.rows);
    // rows [first, end) through layers [from, to), on the intermediates at ``own``
    auto layer_range = [&](int64_t first, int64_t end, int64_t from, int64_t to, T* own) {
        const Step<T> rows = row_range(s, first, end);
        for (int64_t i = from; i < to; ++i) layer_phases(x + first * row_width, layers[i], rows, own, panel_from);
    };
    // rows [first, end) through every layer, a pass at a time (passes of pass_rows, a multiple of
    // the widest panels' rows, rather than of even sizes: 672 rows in passes of 112 left every
    // fourth panel half empty, 10-20% slower than 5 x 128 + 32)
    auto passes = [&](int64_t first, int64_t end, T* own) {
        for (int64_t a = first; a < end; a += s.pass_rows)
            layer_range(a, std::min(end, a + s.pass_rows), 0, count, own);
    };
    // The intermediates, kept per calling thread (the loop thread) from step to step: a fresh
    // buffer would come from new pages every step. One share for the team, or one per thread
    // (for the layer that takes the most), then the output layer's.
    thread_local std::vector<T> scratch;
    size_t share = 0;  // (layers differ where some route to experts and others not: Qwen3-MoE's mlp_only_layers)
    for (int64_t i = 0; i < count; ++i) share = std::max(share, scratch_size(layers[i], std::min(widest, s.pass_rows)));
    const size_t all_shares = share * parts;
    T* base = line_aligned(scratch, all_shares + head_scratch_size<T>(s.sampled, hidden, head.streams));
    T* head_scratch = base + all_shares;
    if (!split) {
#pragma omp parallel
        {
            passes(0, s.rows, base);
            head_phases(x, hidden, head, s, head_scratch, logits, panel_from);
        }
        return;
    }
    std::vector<Carried> carried(parts);
    for (Carried& c : carried) c.layer = count;  // nothing to take until a thread publishes its last pass
    // Rows [first, end) through the layers from ``layer`` on, published in ``mine`` for others to take.
    auto carry = [&](Carried& mine, int64_t first, int64_t end, int64_t layer, T* own) {
        std::unique_lock<std::mutex> hold(mine.lock);
        mine.first = first, mine.end = end, mine.layer = layer;
        while (mine.layer < count) {
            const int64_t i = mine.layer, rows_end = mine.end;
            hold.unlock();
            layer_range(first, rows_end, i, i + 1, own);
            hold.lock();
            mine.layer = i + 1;
            mine.progress.fetch_add(1, std::memory_order_release);
        }
    };
    // The later half of the rows another thread carries, for this thread to carry on (true), or
    // false where none has enough rows and layers left to give.
    // Whether ``c``'s rows may be cut at ``cut``: take_rows each side, and a layer after the one in
    // flight (under c.lock).
    auto can_cut = [&](const Carried& c, int64_t cut) {
        return c.layer + 1 < count && cut - c.first >= s.take_rows && c.end - cut >= s.take_rows;
    };
    auto take = [&](int self, T* own) {
        int64_t most = 0, cut = 0, end = 0, after = 0, seen = 0;
        Carried* from = nullptr;
        for (int t = 0; t < parts; ++t) {
            if (t == self) continue;
            Carried& c = carried[t];
            std::lock_guard<std::mutex> hold(c.lock);
            const int64_t rows = c.end - c.first, layers_left = count - c.layer - 1;  // after the one in flight
            if (rows * layers_left <= most) continue;
            // the sequence start nearest the middle that can_cut
            const int64_t middle = c.first + rows / 2;
            const int64_t* starts_end = s.starts + s.start_count;
            const int64_t* at = std::lower_bound(s.starts, starts_end, middle);
            int64_t best = -1;
            for (const int64_t* p : {at - 1, at})
                if (p >= s.starts && p < starts_end && can_cut(c, *p) &&
                    (best < 0 || std::abs(*p - middle) < std::abs(best - middle)))
                    best = *p;
            if (best < 0) continue;
            most = rows * layers_left, from = &c, cut = best;
        }
        if (from == nullptr) return false;
        {
            std::lock_guard<std::mutex> hold(from->lock);
            // the carrier moved on while this thread looked further: take what is there now
            if (!can_cut(*from, cut)) return true;
            end = from->end, after = from->layer + 1, seen = from->progress.load(std::memory_order_relaxed);
            from->end = cut;
        }
        // the rows' K/V and x for the layer in flight are the carrier's to write
        while (from->progress.load(std::memory_order_acquire) <= seen) std::this_thread::yield();
        __atomic_fetch_add(&s.taken, end - cut, __ATOMIC_RELAXED);
        carry(carried[self], cut, end, after, own);
        return true;
    };
#pragma omp parallel num_threads(parts)
    {
        const StayOnThisCore stay;
        const int self = omp_get_thread_num(), team = omp_get_num_threads();
        T* own = base + share * self;
        // A team of one: the phases' work-sharing loops run whole in this thread.
#pragma omp parallel num_threads(1)
        {
            // ``parts`` shares of the rows, one per thread (or more each, should the team be smaller)
            for (int t = self; t < parts; t += team) {
                const int64_t first = s.shares[t], end = s.shares[t + 1];
                if (first == end) continue;
                const int64_t last = first + (end - first - 1) / s.pass_rows * s.pass_rows;  // the last pass's start
                passes(first, last, own);
                carry(carried[self], last, end, 0, own);
            }
            if (s.take_rows > 0)
                while (take(self, own)) {
                }
        }
#pragma omp barrier
        head_phases(x, hidden, head, s, head_scratch, logits, panel_from);  // every row done: the team's again
    }
}

}  // namespace

// Symbols named as paged_decode.cpp's.
#define LOOM_DECODER_LAYERS(SUFFIX, T, C)                                                                  \
    extern "C" void loom_decoder_layers_##SUFFIX(T* x, const Layer<T, C>* layers, int64_t count,           \
                                                 Step<T>* step, const Head<T>* head, T* logits) {          \
        decoder_layers<T, C>(x, layers, count, *step, *head, logits);                                      \
    }

LOOM_POOL_TYPES(LOOM_DECODER_LAYERS)
