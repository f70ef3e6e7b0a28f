// Fused float32 CPU kernels of the ``cpu`` backend (see deepinfer_cpu/ops.py for the Python side).
//
// Each function implements one op of the DeepInfer contract (the reference function's docstring in
// deepinfer_core/ops/ is the contract) for contiguous float32 tensors.  The work per token is tiny
// (a few hundred multiply-adds), so the point is one call instead of tens of ATen dispatches.
// Every loop runs token by token and the arithmetic of a token never depends on the others, so a
// row's result is bitwise independent of the batch.  Reductions run in a fixed order; where the
// reference sums a few entries over a leading dimension (Sinkhorn's row and column sums, the stream
// collapse) the order is the reference's sequential one.  Built with -ffp-contract=off: no fused
// multiply-add, the same bits on every x86-64 and aarch64 machine.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// Eight floats as one value (GCC/Clang vector extension): one AVX register, two SSE or NEON
// ones.  The loops below are written on it because the auto-vectoriser turns their reductions
// into in-order scalar chains.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Sum of squares of x[0..k) with 8 interleaved partial sums (lane j takes x[j], x[j+8], ...;
// combined pairwise at the end); the order is fixed for a given k.
float sum_squares(const float* x, int64_t k) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const v8 v = load8(x + i);
    acc += v * v;
  }
  for (int j = 0; i < k; ++i, ++j) acc[j] += x[i] * x[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// 1 / sqrt(mean(x²) + eps) of one row.
float inv_rms(const float* x, int64_t k, double eps) {
  return 1.0f / std::sqrt(sum_squares(x, k) / static_cast<float>(k) + static_cast<float>(eps));
}

// out[m] = sum_k x[k] * w_t[k][m] for m < M, w_t the projection transposed and zero-padded to
// [K, MP] columns (MP: M rounded up to 8).  Two accumulators per output (even and odd k, each k
// ascending, added at the end) hide the add latency; the fixed-size m loops vectorise and keep the
// accumulators in registers.  The order depends on k and m only, never on other tokens.
template <int MP>
void project_fixed(const float* __restrict__ x, const float* __restrict__ w_t, int64_t k_dim,
                   float* __restrict__ out) {
  constexpr int V = MP / 8;
  v8 even[V], odd[V];
  for (int v = 0; v < V; ++v) even[v] = odd[v] = v8{0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 2 <= k_dim; k += 2) {
    const float x0 = x[k], x1 = x[k + 1];
    const float* r0 = w_t + k * MP;
    for (int v = 0; v < V; ++v) even[v] += x0 * load8(r0 + 8 * v);
    for (int v = 0; v < V; ++v) odd[v] += x1 * load8(r0 + MP + 8 * v);
  }
  if (k < k_dim) {
    for (int v = 0; v < V; ++v) even[v] += x[k] * load8(w_t + k * MP + 8 * v);
  }
  for (int v = 0; v < V; ++v) {
    const v8 sum = even[v] + odd[v];
    std::memcpy(out + 8 * v, &sum, sizeof sum);
  }
}

// The same sums for any MP (a multiple of 8), with runtime loops (slower, same order).
void project_any(const float* x, const float* w_t, int64_t k_dim, int64_t mp, float* out) {
  std::vector<float> even(mp, 0.0f), odd(mp, 0.0f);
  int64_t k = 0;
  for (; k + 2 <= k_dim; k += 2) {
    for (int64_t m = 0; m < mp; ++m) even[m] += x[k] * w_t[k * mp + m];
    for (int64_t m = 0; m < mp; ++m) odd[m] += x[k + 1] * w_t[(k + 1) * mp + m];
  }
  if (k < k_dim)
    for (int64_t m = 0; m < mp; ++m) even[m] += x[k] * w_t[k * mp + m];
  for (int64_t m = 0; m < mp; ++m) out[m] = even[m] + odd[m];
}

void project(const float* x, const float* w_t, int64_t k_dim, int64_t mp, float* out) {
  switch (mp) {
    case 8: return project_fixed<8>(x, w_t, k_dim, out);
    case 16: return project_fixed<16>(x, w_t, k_dim, out);
    case 24: return project_fixed<24>(x, w_t, k_dim, out);
    case 32: return project_fixed<32>(x, w_t, k_dim, out);
    case 40: return project_fixed<40>(x, w_t, k_dim, out);
    default: return project_any(x, w_t, k_dim, mp, out);
  }
}

int64_t padded8(int64_t m) { return (m + 7) / 8 * 8; }

// fn [M, K] as [K, MP]: transposed, columns M..MP zero.
Tensor transposed_padded(const Tensor& fn) {
  const int64_t m = fn.size(0), k = fn.size(1);
  Tensor out = at::zeros({k, padded8(m)}, fn.options());
  out.narrow(1, 0, m).copy_(fn.t());
  return out;
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

void check_f32(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be a float32 CPU tensor");
}

// rms_norm: y = x * rsqrt(mean(x²) + eps) (* weight), per row of the last dimension.
Tensor rms_norm(const Tensor& x_in, const c10::optional<Tensor>& weight_in, double eps) {
  check_f32(x_in, "x");
  const Tensor x = x_in.contiguous();
  Tensor y = at::empty_like(x);
  const int64_t d = x.dim() ? x.size(-1) : 1;
  const int64_t rows = d ? x.numel() / d : 0;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* wp = nullptr;
  Tensor weight;
  if (weight_in.has_value()) {
    weight = weight_in->contiguous();
    check_f32(weight, "weight");
    TORCH_CHECK(weight.numel() == d, "weight must have ", d, " entries");
    wp = weight.data_ptr<float>();
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    float* yr = yp + r * d;
    const float f = inv_rms(xr, d, eps);
    if (wp) {
      for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * f) * wp[i];
    } else {
      for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * f;
    }
  }
  return y;
}

// Sinkhorn-Knopp on one token's n x n matrix a (row-major), in place: columns, then iters-1
// rounds of rows and columns, each entry divided by (its column's / row's sum + eps), the sums
// taken in index order with eps added last (the reference's bordered sums).  NN > 0: n known at
// compile time (the matrix stays in registers, the divisions vectorise); NN == 0: any n.
template <int NN>
void sinkhorn(float* __restrict__ a_out, int64_t n_any, int64_t iters, float eps) {
  const int64_t n = NN > 0 ? NN : n_any;
  float fixed[NN > 0 ? NN * NN : 1];
  std::vector<float> dynamic(NN > 0 ? 0 : n * n);
  float* __restrict__ a = NN > 0 ? fixed : dynamic.data();
  for (int64_t i = 0; i < n * n; ++i) a[i] = a_out[i];
  float cols[NN > 0 ? NN : 64];
  std::vector<float> cols_dynamic(NN > 0 || n <= 64 ? 0 : n);
  float* __restrict__ sums = NN > 0 || n <= 64 ? cols : cols_dynamic.data();
  for (int64_t it = 0; it < iters; ++it) {
    if (it > 0) {  // rows
      for (int64_t i = 0; i < n; ++i) {
        float s = a[i * n];
        for (int64_t j = 1; j < n; ++j) s += a[i * n + j];
        s += eps;
        for (int64_t j = 0; j < n; ++j) a[i * n + j] /= s;
      }
    }
    for (int64_t j = 0; j < n; ++j) sums[j] = a[j];  // columns
    for (int64_t i = 1; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) sums[j] += a[i * n + j];
    for (int64_t j = 0; j < n; ++j) sums[j] += eps;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) a[i * n + j] /= sums[j];
  }
  for (int64_t i = 0; i < n * n; ++i) a_out[i] = a[i];
}

// hc_pre: the mHC mixing weights of one block and its collapsed input (see the op's docstring).
// Per token: unweighted RMS norm of the N*D streams, the (2+N)*N mixing logits z = base + (x·fn)
// * scale[group], pre = sigmoid(z)+eps, post = 2 sigmoid(z), comb = Sinkhorn(softmax_row(z)+eps),
// collapsed = sum_n pre_n * streams_n.
std::tuple<Tensor, Tensor, Tensor> hc_pre(const Tensor& streams_in, const Tensor& fn, const Tensor& base_in,
                                          const Tensor& scale_in, double norm_eps, double hc_eps,
                                          int64_t iters) {
  check_f32(streams_in, "streams");
  check_f32(fn, "fn");
  check_f32(base_in, "base");
  check_f32(scale_in, "scale");
  TORCH_CHECK(streams_in.dim() == 3, "streams must be [T, N, D]");
  const Tensor streams = streams_in.contiguous();
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  const int64_t m_dim = (2 + n) * n, k_dim = n * d;
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == m_dim && fn.size(1) == k_dim, "fn must be [(2+N)*N, N*D]");
  const Tensor fn_t = transposed_padded(fn);  // [N*D, MP]
  const Tensor base = base_in.contiguous(), scale = scale_in.contiguous();
  Tensor post = at::empty({t, n}, streams.options());
  Tensor comb = at::empty({t, n, n}, streams.options());
  Tensor collapsed = at::empty({t, d}, streams.options());
  const float* sp = streams.data_ptr<float>();
  const float* wp = fn_t.data_ptr<float>();
  const float* bp = base.data_ptr<float>();
  const float* sc = scale.data_ptr<float>();
  float* postp = post.data_ptr<float>();
  float* combp = comb.data_ptr<float>();
  float* outp = collapsed.data_ptr<float>();
  const float eps = static_cast<float>(hc_eps);
  std::vector<float> flat(k_dim), z(padded8(m_dim)), pre(n);
  for (int64_t tok = 0; tok < t; ++tok) {
    const float* s = sp + tok * k_dim;
    const float f = inv_rms(s, k_dim, norm_eps);
    for (int64_t k = 0; k < k_dim; ++k) flat[k] = s[k] * f;
    project(flat.data(), wp, k_dim, padded8(m_dim), z.data());
    for (int64_t m = 0; m < m_dim; ++m) {
      const float group_scale = sc[m < n ? 0 : (m < 2 * n ? 1 : 2)];
      z[m] = bp[m] + z[m] * group_scale;
    }
    for (int64_t i = 0; i < n; ++i) {
      pre[i] = sigmoid(z[i]) + eps;
      const float g = sigmoid(z[n + i]);
      postp[tok * n + i] = g + g;
    }
    float* c = combp + tok * n * n;  // softmax of each row of the N x N logits, + eps
    for (int64_t i = 0; i < n; ++i) {
      const float* row = z.data() + 2 * n + i * n;
      float mx = row[0];
      for (int64_t j = 1; j < n; ++j) mx = std::max(mx, row[j]);
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) total += (c[i * n + j] = std::exp(row[j] - mx));
      for (int64_t j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / total + eps;
    }
    if (n == 4) {
      sinkhorn<4>(c, n, iters, eps);  // V4's hc_mult
    } else {
      sinkhorn<0>(c, n, iters, eps);
    }
    float* out = outp + tok * d;
    for (int64_t e = 0; e < d; ++e) out[e] = pre[0] * s[e];
    for (int64_t i = 1; i < n; ++i)
      for (int64_t e = 0; e < d; ++e) out[e] += pre[i] * s[i * d + e];
  }
  return {post, comb, collapsed};
}

// hc_post: out[n] = post_n * block_out + sum_j comb[j, n] * streams_j, per token.
Tensor hc_post(const Tensor& block_out_in, const Tensor& streams_in, const Tensor& post_in,
               const Tensor& comb_in) {
  check_f32(block_out_in, "block_out");
  check_f32(streams_in, "streams");
  check_f32(post_in, "post");
  check_f32(comb_in, "comb");
  const Tensor bo = block_out_in.contiguous(), streams = streams_in.contiguous();
  const Tensor post = post_in.contiguous(), comb = comb_in.contiguous();
  TORCH_CHECK(streams.dim() == 3, "streams must be [T, N, D]");
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2);
  TORCH_CHECK(bo.numel() == t * d && post.numel() == t * n && comb.numel() == t * n * n,
              "block_out, post and comb must be [T, D], [T, N] and [T, N, N]");
  Tensor out = at::empty_like(streams);
  const float* bp = bo.data_ptr<float>();
  const float* sp = streams.data_ptr<float>();
  const float* pp = post.data_ptr<float>();
  const float* cp = comb.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t tok = 0; tok < t; ++tok) {
    const float* s = sp + tok * n * d;
    const float* c = cp + tok * n * n;
    const float* b = bp + tok * d;
    for (int64_t i = 0; i < n; ++i) {
      float* o = op + (tok * n + i) * d;
      const float p = pp[tok * n + i];
      for (int64_t e = 0; e < d; ++e) o[e] = c[i] * s[e];
      for (int64_t j = 1; j < n; ++j) {
        const float w = c[j * n + i];
        for (int64_t e = 0; e < d; ++e) o[e] += w * s[j * d + e];
      }
      for (int64_t e = 0; e < d; ++e) o[e] += p * b[e];
    }
  }
  return out;
}

// hc_head: sum_n (sigmoid(mix_n * scale + base_n) + eps) * streams_n, mix = rms(x)·fn, per token.
Tensor hc_head(const Tensor& streams_in, const Tensor& fn, const Tensor& base_in, const Tensor& scale_in,
               double norm_eps, double hc_eps) {
  check_f32(streams_in, "streams");
  check_f32(fn, "fn");
  check_f32(base_in, "base");
  check_f32(scale_in, "scale");
  TORCH_CHECK(streams_in.dim() == 3, "streams must be [T, N, D]");
  const Tensor streams = streams_in.contiguous();
  const int64_t t = streams.size(0), n = streams.size(1), d = streams.size(2), k_dim = n * d;
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == n && fn.size(1) == k_dim, "fn must be [N, N*D]");
  const Tensor fn_t = transposed_padded(fn);  // [N*D, MP]
  const Tensor base = base_in.contiguous();
  Tensor out = at::empty({t, d}, streams.options());
  const float* sp = streams.data_ptr<float>();
  const float* wp = fn_t.data_ptr<float>();
  const float* bp = base.data_ptr<float>();
  const float scale = scale_in.contiguous().data_ptr<float>()[0];
  const float eps = static_cast<float>(hc_eps);
  float* op = out.data_ptr<float>();
  std::vector<float> flat(k_dim), mix(padded8(n)), pre(n);
  for (int64_t tok = 0; tok < t; ++tok) {
    const float* s = sp + tok * k_dim;
    const float f = inv_rms(s, k_dim, norm_eps);
    for (int64_t k = 0; k < k_dim; ++k) flat[k] = s[k] * f;
    project(flat.data(), wp, k_dim, padded8(n), mix.data());
    for (int64_t i = 0; i < n; ++i) pre[i] = sigmoid(mix[i] * scale + bp[i]) + eps;
    float* o = op + tok * d;
    for (int64_t e = 0; e < d; ++e) o[e] = pre[0] * s[e];
    for (int64_t i = 1; i < n; ++i)
      for (int64_t e = 0; e < d; ++e) o[e] += pre[i] * s[i * d + e];
  }
  return out;
}


// Dot product of a[0..k) and b[0..k) with 8 interleaved partial sums (the order of sum_squares).
float dot(const float* a, const float* b, int64_t k) {
  v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) acc += load8(a + i) * load8(b + i);
  for (int j = 0; i < k; ++i, ++j) acc[j] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// o[0..d) += p * v[0..d) (elementwise: the same bits as the scalar loop).
void axpy(float* __restrict__ o, float p, const float* __restrict__ v, int64_t d) {
  int64_t e = 0;
  for (; e + 8 <= d; e += 8) {
    const v8 r = load8(o + e) + p * load8(v + e);
    std::memcpy(o + e, &r, sizeof r);
  }
  for (; e < d; ++e) o[e] += p * v[e];
}

void check_i64(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.device().is_cpu(), name, " must be an int64 CPU tensor");
}

// One source of key rows: an explicit [T, K] row list (-1 = no key), or a paged index
// (entries 0 .. counts[t]-1 through a block table).  rows_of(t, out) appends query t's valid
// pool rows, in column (entry) order, to out.
struct Source {
  Tensor held;
  const float* pool = nullptr;
  int64_t pool_rows = 0, row_stride = 0;
  // explicit rows
  Tensor rows;
  const int64_t* rp = nullptr;
  int64_t width = 0;
  // paged
  Tensor table, token_rows, counts;
  const int64_t* tp = nullptr;
  const int64_t* trp = nullptr;
  const int64_t* cp = nullptr;
  int64_t epp = 0, pages = 0, max_count = 0;

  Source(const Tensor& pool_t, const Tensor& rows_in, const Tensor& table_in, const Tensor& token_rows_in,
         const Tensor& counts_in, int64_t entries_per_page, int64_t max_count_in, int64_t t, int64_t d) {
    check_f32(pool_t, "kv pool");
    TORCH_CHECK(pool_t.dim() == 2 && pool_t.size(1) == d, "kv pools must be [N, D] with q's D");
    held = pool_t.stride(1) == 1 ? pool_t : pool_t.contiguous();  // rows may be strided
    pool = held.data_ptr<float>();
    pool_rows = held.size(0);
    row_stride = held.stride(0);
    epp = entries_per_page;
    if (epp == 0) {
      check_i64(rows_in, "indices");
      rows = rows_in.contiguous();
      TORCH_CHECK(rows.dim() == 2 && rows.size(0) == t, "indices must be [T, K]");
      width = rows.size(1);
      rp = rows.data_ptr<int64_t>();
    } else {
      check_i64(table_in, "block_table");
      check_i64(token_rows_in, "token_rows");
      check_i64(counts_in, "counts");
      table = table_in.contiguous();
      token_rows = token_rows_in.contiguous();
      counts = counts_in.contiguous();
      TORCH_CHECK(table.dim() == 2 && token_rows.numel() == t && counts.numel() == t,
                  "a paged index needs a [R, P] block table and [T] token rows and counts");
      tp = table.data_ptr<int64_t>();
      trp = token_rows.data_ptr<int64_t>();
      cp = counts.data_ptr<int64_t>();
      pages = table.size(1);
      max_count = max_count_in;
    }
  }

  int64_t row(int64_t t, int64_t e) const {
    if (epp == 0) return rp[t * width + e];
    if (e >= std::min(cp[t], max_count)) return -1;
    const int64_t col = std::min(e / epp, pages - 1);
    return tp[trp[t] * pages + col] * epp + e % epp;
  }

  int64_t columns(int64_t t) const { return epp == 0 ? width : std::max<int64_t>(0, std::min(cp[t], max_count)); }

  void rows_of(int64_t t, std::vector<const float*>& out, int64_t d) const {
    const int64_t n = columns(t);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t r = row(t, e);
      if (r < 0) continue;
      TORCH_CHECK(r < pool_rows, "key row ", r, " is outside a pool of ", pool_rows, " rows");
      out.push_back(pool + r * row_stride);
    }
  }
};

std::vector<Source> make_sources(const std::vector<Tensor>& pools, const std::vector<Tensor>& rows,
                                 const std::vector<Tensor>& tables, const std::vector<Tensor>& token_rows,
                                 const std::vector<Tensor>& counts, const std::vector<int64_t>& epp,
                                 const std::vector<int64_t>& max_count, int64_t t, int64_t d) {
  const size_t n = pools.size();
  TORCH_CHECK(rows.size() == n && tables.size() == n && token_rows.size() == n && counts.size() == n &&
                  epp.size() == n && max_count.size() == n,
              "one index per kv pool");
  std::vector<Source> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i)
    out.emplace_back(pools[i], rows[i], tables[i], token_rows[i], counts[i], epp[i], max_count[i], t, d);
  return out;
}

// sparse_attention: per query, its valid key rows (sources in order, then columns; -1 slots
// skipped), per head the fp32 logits scale * q·k, the softmax over [logits..., sink] (max,
// exp(x - max), sum in key order with the sink's term last) and the weighted sum of the key
// rows in key order.  A query's result depends only on the sequence of its valid keys (never on
// the batch or the -1 padding): batch invariant in either mode.  No key: zeros.
Tensor sparse_attention(const Tensor& q_in, const std::vector<Tensor>& pools, const std::vector<Tensor>& rows,
                        const std::vector<Tensor>& tables, const std::vector<Tensor>& token_rows,
                        const std::vector<Tensor>& counts, const std::vector<int64_t>& epp,
                        const std::vector<int64_t>& max_count, const Tensor& sinks_in, double scale_d) {
  check_f32(q_in, "q");
  check_f32(sinks_in, "sinks");
  TORCH_CHECK(q_in.dim() == 3, "q must be [T, H, D]");
  const Tensor q = q_in.contiguous(), sinks = sinks_in.contiguous();
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(sinks.numel() == h, "sinks must be [H]");
  const std::vector<Source> sources = make_sources(pools, rows, tables, token_rows, counts, epp, max_count, t, d);
  Tensor out = at::zeros({t, h, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* sp = sinks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(scale_d);
  std::vector<const float*> keys;
  std::vector<float> logits;
  for (int64_t tok = 0; tok < t; ++tok) {
    keys.clear();
    for (const Source& s : sources) s.rows_of(tok, keys, d);
    const int64_t k = static_cast<int64_t>(keys.size());
    if (k == 0) continue;  // zeros
    logits.resize(k);
    for (int64_t hh = 0; hh < h; ++hh) {
      const float* qr = qp + (tok * h + hh) * d;
      float mx = sp[hh];
      for (int64_t j = 0; j < k; ++j) {
        logits[j] = dot(qr, keys[j], d) * scale;
        mx = std::max(mx, logits[j]);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < k; ++j) total += (logits[j] = std::exp(logits[j] - mx));
      total += std::exp(sp[hh] - mx);
      float* o = op + (tok * h + hh) * d;
      for (int64_t j = 0; j < k; ++j) axpy(o, logits[j] / total, keys[j], d);
    }
  }
  return out;
}

// apply_rope: the trailing 2 * R/2 channels of each vector rotate in interleaved pairs by the
// token's (cos, sin): (a, b) -> (a c - b s, a s + b c); the leading channels are copied.
Tensor apply_rope(const Tensor& x_in, const Tensor& cos_in, const Tensor& sin_in) {
  check_f32(x_in, "x");
  check_f32(cos_in, "cos");
  check_f32(sin_in, "sin");
  TORCH_CHECK(x_in.dim() == 2 || x_in.dim() == 3, "x must be [T, D] or [T, H, D]");
  const Tensor x = x_in.contiguous(), cs = cos_in.contiguous(), sn = sin_in.contiguous();
  const int64_t t = x.size(0), d = x.size(-1), h = x.dim() == 3 ? x.size(1) : 1;
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == t && sn.sizes() == cs.sizes(), "cos and sin must be [T, R/2]");
  const int64_t half = cs.size(1), nope = d - 2 * half;
  TORCH_CHECK(nope >= 0, "the rope slice (", 2 * half, " channels) is wider than x (", d, ")");
  Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t tok = 0; tok < t; ++tok) {
    const float* c = cp + tok * half;
    const float* s = sp + tok * half;
    for (int64_t hh = 0; hh < h; ++hh) {
      const float* xr = xp + (tok * h + hh) * d;
      float* o = op + (tok * h + hh) * d;
      std::memcpy(o, xr, nope * sizeof(float));
      for (int64_t i = 0; i < half; ++i) {
        const float a = xr[nope + 2 * i], b = xr[nope + 2 * i + 1];
        o[nope + 2 * i] = a * c[i] - b * s[i];
        o[nope + 2 * i + 1] = a * s[i] + b * c[i];
      }
    }
  }
  return out;
}

// compress_entries: per window, the per-channel softmax of the gate over the L rows (max,
// exp(x - max), sum in row order), the pooled row sum_l kv[l] * p[l] (row order), the weighted
// RMS norm, the rope rotation at the window's position (cos/sin of float(pos) * inv_freq, times
// rope_scale) and the store into pool[dest[m]].
Tensor compress_entries(const Tensor& kv_in, const Tensor& gate_in, const Tensor& weight_in, double eps,
                        const Tensor& positions_in, const Tensor& inv_freq_in, double rope_scale, Tensor pool,
                        const Tensor& dest_in) {
  check_f32(kv_in, "kv");
  check_f32(gate_in, "gate");
  check_f32(weight_in, "norm_weight");
  check_f32(inv_freq_in, "inv_freq");
  check_f32(pool, "pool");
  check_i64(positions_in, "positions");
  check_i64(dest_in, "dest");
  TORCH_CHECK(kv_in.dim() == 3 && gate_in.sizes() == kv_in.sizes(), "kv and gate must be [M, L, D]");
  TORCH_CHECK(pool.dim() == 2 && pool.stride(1) == 1 && pool.size(1) == kv_in.size(2),
              "pool must be [N, D] with contiguous rows");
  const Tensor kv = kv_in.contiguous(), gate = gate_in.contiguous(), weight = weight_in.contiguous();
  const Tensor positions = positions_in.contiguous(), inv_freq = inv_freq_in.contiguous();
  const Tensor dest = dest_in.contiguous();
  const int64_t m = kv.size(0), l = kv.size(1), d = kv.size(2), half = inv_freq.numel(), n = pool.size(0);
  TORCH_CHECK(weight.numel() == d && positions.numel() == m && dest.numel() == m && 2 * half <= d,
              "norm_weight [D], positions [M], dest [M], inv_freq [<= D/2]");
  const float* kp = kv.data_ptr<float>();
  const float* gp = gate.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* fp = inv_freq.data_ptr<float>();
  const int64_t* dp = dest.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  const float rs = static_cast<float>(rope_scale);
  std::vector<float> mx(d), total(d), pooled(d), entry(d), ex(l * d);
  for (int64_t w = 0; w < m; ++w) {
    TORCH_CHECK(dp[w] >= 0 && dp[w] < n, "dest row ", dp[w], " is outside a pool of ", n, " rows");
    const float* g = gp + w * l * d;
    const float* x = kp + w * l * d;
    for (int64_t e = 0; e < d; ++e) mx[e] = g[e];
    for (int64_t r = 1; r < l; ++r)
      for (int64_t e = 0; e < d; ++e) mx[e] = std::max(mx[e], g[r * d + e]);
    for (int64_t e = 0; e < d; ++e) total[e] = 0.0f;
    for (int64_t r = 0; r < l; ++r)
      for (int64_t e = 0; e < d; ++e) total[e] += (ex[r * d + e] = std::exp(g[r * d + e] - mx[e]));
    for (int64_t e = 0; e < d; ++e) pooled[e] = 0.0f;
    for (int64_t r = 0; r < l; ++r)
      for (int64_t e = 0; e < d; ++e) pooled[e] += x[r * d + e] * (ex[r * d + e] / total[e]);
    const float f = inv_rms(pooled.data(), d, eps);
    for (int64_t e = 0; e < d; ++e) entry[e] = (pooled[e] * f) * wp[e];
    float* o = pp + dp[w] * pool.stride(0);
    const int64_t nope = d - 2 * half;
    std::memcpy(o, entry.data(), nope * sizeof(float));
    const float p = static_cast<float>(pos[w]);
    for (int64_t i = 0; i < half; ++i) {
      const float ang = p * fp[i];
      const float c = std::cos(ang) * rs, s = std::sin(ang) * rs;
      const float a = entry[nope + 2 * i], b = entry[nope + 2 * i + 1];
      o[nope + 2 * i] = a * c - b * s;
      o[nope + 2 * i + 1] = a * s + b * c;
    }
  }
  return pool;
}

// indexer_topk: per query, the score of each valid candidate, sum_h w[h] * (relu(q_h·key) *
// scale) (heads in order; -inf for -1), the kk = min(k, C) best columns by (score descending,
// column ascending) -- a stable descending sort's first kk -- best first, or in column order
// (column_order: the batch-invariant mode's contract), as pool rows (-1 for an invalid pick).
Tensor indexer_topk(const Tensor& q_in, const Tensor& weights_in, const Tensor& keys_in, const Tensor& rows,
                    const Tensor& table, const Tensor& token_rows, const Tensor& counts, int64_t epp,
                    int64_t max_count, int64_t k, double scale_d, bool column_order) {
  check_f32(q_in, "q");
  check_f32(weights_in, "weights");
  TORCH_CHECK(q_in.dim() == 3, "q must be [T, H, D]");
  const Tensor q = q_in.contiguous(), weights = weights_in.contiguous();
  const int64_t t = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == t && weights.size(1) == h, "weights must be [T, H]");
  const Source src(keys_in, rows, table, token_rows, counts, epp, max_count, t, d);
  const int64_t c = epp == 0 ? src.width : max_count;
  const int64_t kk = std::max<int64_t>(0, std::min(k, c));
  Tensor out = at::empty({t, kk}, q.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  const float scale = static_cast<float>(scale_d);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> score(c);
  std::vector<int64_t> row(c), order(c);
  for (int64_t tok = 0; tok < t; ++tok) {
    const float* w = wp + tok * h;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t r = src.row(tok, j);
      row[j] = r;
      if (r < 0) {
        score[j] = ninf;
        continue;
      }
      TORCH_CHECK(r < src.pool_rows, "key row ", r, " is outside a pool of ", src.pool_rows, " rows");
      const float* key = src.pool + r * src.row_stride;
      float acc = 0.0f;
      for (int64_t hh = 0; hh < h; ++hh) {
        const float s = std::max(dot(qp + (tok * h + hh) * d, key, d), 0.0f) * scale;
        acc += w[hh] * s;
      }
      score[j] = acc;
    }
    for (int64_t j = 0; j < c; ++j) order[j] = j;
    std::partial_sort(order.begin(), order.begin() + kk, order.end(), [&](int64_t a, int64_t b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    if (column_order) std::sort(order.begin(), order.begin() + kk);
    for (int64_t j = 0; j < kk; ++j) op[tok * kk + j] = row[order[j]];
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused float32 CPU kernels of DeepInfer's cpu backend";
  m.def("rms_norm", &rms_norm, "RMS norm over the last dimension (weight optional)");
  m.def("hc_pre", &hc_pre, "mHC pre: mixing weights (post, comb) and the collapsed input");
  m.def("hc_post", &hc_post, "mHC post: expand a block's output into the streams and mix");
  m.def("hc_head", &hc_head, "mHC head: the final collapse of the streams");
  m.def("sparse_attention", &sparse_attention, "Single-KV-head attention over per-query key lists, with sinks");
  m.def("apply_rope", &apply_rope, "Interleaved rotary embedding of the trailing channels");
  m.def("compress_entries", &compress_entries, "Pool, norm, rotate and store compressor entries");
  m.def("indexer_topk", &indexer_topk, "Lightning-indexer top-k of the candidates");
}
