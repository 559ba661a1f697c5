/* `prefixgate::attend` on a CPU, in C++: a packed step's attention where the C kernel attends it (see attention.py
   and cpu_attention.py). A compiled step (C++ itself on a CPU) calls it with no Python between: through the operator
   written in Python, each of SmolLM2's 30 layers cost about 55 us besides the kernel's own work a step (README,
   "Benchmarks").

   The step is laid out once, in Python, before its first layer (`cpu_attention.StepLayout`): the kernel's address,
   and the kernel's plans of each request's own positions and of each run of shared positions with the rows that read
   it. `prefixgate_set_step` hands it to the thread that runs the step. With no step laid out on this thread (the
   model called outside a packed step, or where the kernel does not take it), or for a sliding window or
   soft-capping, the operator is `prefixgate::attend_torch`, written in Python with torch's kernels. */

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <math.h>
#include <stdint.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

/* cpu_attention.c's `prefixgate_attend_parts`: queries, outputs, log-sum-exps and the new keys and values, each with
   its head and row strides; KV heads, query heads per KV head, the head size, the scale, the layer; the parts. */
typedef int (*attend_parts)(const void *q, int64_t q_head, int64_t q_row, void *out, int64_t out_head,
                            int64_t out_row, float *lse, int64_t lse_head, int64_t lse_row, const void *new_k,
                            int64_t new_k_head, int64_t new_k_row, const void *new_v, int64_t new_v_head,
                            int64_t new_v_row, int64_t kv_heads, int64_t groups, int64_t d, float scale,
                            int64_t layer, int64_t count, const int64_t *plans);

/* The shared positions the same rows read, one kernel plan (eight int64, its rows' place in it) a run of them; with
   `rows`, those rows are the `count` listed there (an int64 tensor's data), gathered for the calls as they are not
   side by side in the step. */
struct prefixgate_readers {
    int64_t count;
    const int64_t *rows;
    int64_t runs;
    const int64_t *plans;
};

/* A step laid out for the kernel (cpu_attention.StepLayout's structure): each request's own part, then each group of
   shared readers. */
struct prefixgate_step {
    attend_parts kernel;           /* for calls whose parts have at most `few_rows` query rows a KV head */
    attend_parts many_rows_kernel; /* for the rest (another build only for float32 on AVX-512, see cpu_attention.py) */
    int64_t few_rows;
    int64_t bfloat16; /* 1: the kernel's bfloat16 build; 0: its float32 one */
    int64_t kv_heads, head_dim, layers;
    int64_t parts;
    const int64_t *plans;
    int64_t groups;
    const prefixgate_readers *readers;
};

static thread_local const prefixgate_step *current_step = nullptr;

/* Set the step this thread runs (null: none), for the layers' calls of the operator until the next. */
extern "C" void prefixgate_set_step(const prefixgate_step *step) { current_step = step; }

static void attend_checked(const prefixgate_step *step, const at::Tensor &q, const at::Tensor &out,
                           const at::Tensor &lse, const at::Tensor *new_k, const at::Tensor *new_v, double scale,
                           int64_t layer, int64_t count, const int64_t *plans) {
    int64_t longest = 0; /* the largest part's rows: a plan's second number */
    for (int64_t p = 0; p < count; p++) longest = std::max(longest, plans[8 * p + 1]);
    const attend_parts kernel =
        longest * (q.size(1) / step->kv_heads) > step->few_rows ? step->many_rows_kernel : step->kernel;
    const int failed = kernel(
        q.const_data_ptr(), q.stride(1), q.stride(2), out.mutable_data_ptr(), out.stride(1), out.stride(2),
        lse.mutable_data_ptr<float>(), lse.stride(1), lse.stride(2), new_k ? new_k->const_data_ptr() : nullptr,
        new_k ? new_k->stride(1) : 0, new_k ? new_k->stride(2) : 0, new_v ? new_v->const_data_ptr() : nullptr,
        new_v ? new_v->stride(1) : 0, new_v ? new_v->stride(2) : 0, step->kv_heads, q.size(1) / step->kv_heads,
        step->head_dim, (float)scale, layer, count, plans);
    TORCH_CHECK(failed != -2, "the attention kernel could not allocate its working memory");
    TORCH_CHECK(failed == 0, "the attention kernel does not take this step's sizes: queries ", q.sizes(), ", layer ",
                layer);
}

/* Attend the step laid out: one kernel call writes each request's new K and V into its buffer and attends its own
   positions, causally, and the runs of shared positions whose readers lie side by side, each merged into its readers'
   rows after the parts before it; then a call a run of the other readers' (gathered and put back). All into one output
   in place, made in the layout the step returns. */
static at::Tensor attend_step(const prefixgate_step *step, const at::Tensor &query, const at::Tensor &key,
                              const at::Tensor &value, int64_t layer, double scale) {
    // query: [1, heads, total, head_dim]; key, value: [1, kv_heads, total, head_dim]
    const int64_t heads = query.size(1), total = query.size(2), d = query.size(3);
    const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
    const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
    const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
    at::Tensor out = at::empty({1, total, heads, d}, q.options()).transpose(1, 2);  // out: [1, heads, total, d]
    at::Tensor lse = at::full({1, heads, total}, -INFINITY, q.options().dtype(at::kFloat));  // nothing attended yet
    attend_checked(step, q, out, lse, &k, &v, scale, layer, step->parts, step->plans);
    for (int64_t g = 0; g < step->groups; g++) {
        const prefixgate_readers &readers = step->readers[g];
        if (!readers.rows) {  // side by side: read and written where they are
            for (int64_t r = 0; r < readers.runs; r++)
                attend_checked(step, q, out, lse, nullptr, nullptr, scale, layer, 1, readers.plans + 8 * r);
            continue;
        }
        const at::Tensor rows = at::from_blob(const_cast<int64_t *>(readers.rows), {readers.count}, at::kLong);
        const at::Tensor picked = q.index_select(2, rows);
        at::Tensor own = out.index_select(2, rows), own_lse = lse.index_select(2, rows);
        for (int64_t r = 0; r < readers.runs; r++)
            attend_checked(step, picked, own, own_lse, nullptr, nullptr, scale, layer, 1, readers.plans + 8 * r);
        out.index_copy_(2, rows, own);
        lse.index_copy_(2, rows, own_lse);
    }
    return out.transpose(1, 2);  // [1, total, heads, head_dim], contiguous: out was made in this layout
}

static at::Tensor attend(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, int64_t layer,
                         double scale, std::optional<int64_t> sliding_window, std::optional<double> softcap) {
    const prefixgate_step *step = current_step;
    if (step && !sliding_window && !softcap && query.scalar_type() == (step->bfloat16 ? at::kBFloat16 : at::kFloat) &&
        key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
        query.size(3) == step->head_dim && key.size(1) == step->kv_heads && query.size(1) % step->kv_heads == 0 &&
        layer >= 0 && layer < step->layers)
        return attend_step(step, query, key, value, layer, scale);
    static const auto attend_torch =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("prefixgate::attend_torch", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, double,
                              std::optional<int64_t>, std::optional<double>)>();
    return attend_torch.call(query, key, value, layer, scale, sliding_window, softcap);
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("attend", &attend); }
