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
#include <cstdint>
#include <cstring>
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused float32 CPU kernels of DeepInfer's cpu backend";
  m.def("rms_norm", &rms_norm, "RMS norm over the last dimension (weight optional)");
  m.def("hc_pre", &hc_pre, "mHC pre: mixing weights (post, comb) and the collapsed input");
  m.def("hc_post", &hc_post, "mHC post: expand a block's output into the streams and mix");
  m.def("hc_head", &hc_head, "mHC head: the final collapse of the streams");
}
