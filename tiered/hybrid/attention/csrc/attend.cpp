// The `native` attention kernel of tiered: every piece's attention in one call.
//
// Contract (tiered/hybrid/attention/kernels.py, native.py): q [L, H, Dh] is overwritten with
// softmax(q k^T / sqrt(Dh)) v, where each query of a piece sees (1) the shared prefix, read from
// a pool [blocks, block_tokens, Hkv, Dh] through a block-id list, (2) its piece's visible key
// ranges, (3) its own keys causally. GQA: the H / Hkv query heads of a KV head form a group.
//
// Work: one task = (piece, KV head, block of query positions); its rows are the block's
// positions x the group's heads, so every K/V tile is loaded (and converted from bf16) once for
// the whole group. Per key tile: S = Q K^T (a small GEMM against K packed transposed), an online
// fp32 softmax in base 2 (log2(e) folded into the scores' scale), acc += P V. Tasks are handed out
// largest first from an atomic counter inside at::parallel_for (causal blocks differ in cost).
// The shared prefix's tiles are converted (widened to fp32 or packed in bf16 pairs) once per call
// for all tasks, when more than one task per KV head reads them and the copy stays small.
// Values and outputs are kept Dp wide inside (the head dim rounded up to the path's register
// width, zero columns past it), so every head dim runs on every path.
//
// ISA paths, chosen at run time (__builtin_cpu_supports) or forced by the `isa` argument:
// scalar (portable C++), avx2 (AVX2 + FMA), avx512 (AVX-512F), avx512bf16 (avx512 + BW, with
// Q K^T and P V of bf16 inputs by _mm512_dpbf16_ps: P rounded to bf16, V packed in pairs of
// keys; even head dims), amx (avx512bf16 with both products on AMX tiles, tdpbf16ps; head dims
// multiples of 32 up to 256; built where the compiler knows AMX). Each ISA's functions carry a
// target attribute, so this file compiles with plain -O3 and the library runs on any x86-64 CPU.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"

#if TIERED_X86
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace tiered_native;

#if TIERED_AMX
// Linux hands a process the AMX tile data state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Asked once per process.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#endif

bool cpu_runs(const std::string& isa) {
  if (isa == "scalar") return true;
#if TIERED_X86
  __builtin_cpu_init();
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512") return __builtin_cpu_supports("avx512f");
  if (isa == "avx512bf16")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
#if TIERED_AMX
  if (isa == "amx")
    return cpu_runs("avx512bf16") && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           amx_granted();
#endif
#endif
  return false;
}

const Ops* ops_named(const std::string& isa) {
  if (isa == "scalar") return &kScalar;
#if TIERED_X86
  if (isa == "avx2") return &kAvx2;
  if (isa == "avx512") return &kAvx512;
  if (isa == "avx512bf16") return &kAvx512Bf16;
#if TIERED_AMX
  if (isa == "amx") return &kAmx;
#endif
#endif
  return nullptr;
}

const char* const kPaths[] = {"amx", "avx512bf16", "avx512", "avx2", "scalar"};  // best first

// Whether `ops` computes at head dim Dh (every path pads the value width; dot products take whole units).
bool takes_head_dim(const Ops* ops, int Dh) {
  return Dh % ops->head_dim_step == 0 && (ops->max_head_dim == 0 || Dh <= ops->max_head_dim);
}

// The path for `isa` ("auto": the best this CPU runs at this head dim); errors name the reason.
const Ops* choose_ops(const std::string& isa, int Dh) {
  if (isa == "auto") {
    for (const char* name : kPaths) {
      const Ops* ops = ops_named(name);
      if (ops && cpu_runs(name) && takes_head_dim(ops, Dh)) return ops;
    }
  }
  const Ops* ops = ops_named(isa);
  TORCH_CHECK(isa != "amx" || ops != nullptr, "native attention: this build has no amx path (its compiler predates AMX)");
  TORCH_CHECK(ops != nullptr, "native attention: unknown isa '", isa, "' (scalar, avx2, avx512, avx512bf16, amx, auto)");
  TORCH_CHECK(cpu_runs(isa), "native attention: this CPU cannot run the ", isa, " path");
  TORCH_CHECK(takes_head_dim(ops, Dh), "native attention: the ", isa, " path takes head dims that are multiples of ",
              ops->head_dim_step, ops->max_head_dim ? " up to " + std::to_string(ops->max_head_dim) : std::string(),
              ", got ", Dh);
  return ops;
}

// ---- the driver: tasks, tiles, packing -----------------------------------------------------------

template <typename T>
struct Args {
  T* q;
  int64_t q_row, q_head;
  const T *k, *v;
  int64_t k_row, k_head, v_row, v_head;
  const T *pool_k, *pool_v;  // null: no prefix
  int64_t pk_block, pk_row, pk_head, pv_block, pv_row, pv_head;
  const int64_t* block_ids;
  int64_t num_ids, block_tokens, prefix_tokens;
  const int64_t* pieces;   // [n, 5]: q_start, k_start, num, first visible, end visible
  const int64_t* visible;  // [m, 2]: begin, end
  int group, Dh, rows_per_block;
  int Dp;       // the width of values and outputs inside the kernel: Dh rounded up to the path's column step
  float scale;  // 1 / sqrt(Dh) x log2(e)
};

struct Task {
  int64_t piece, head, q0, nq, cost;
};

// A thread's buffers, for `rows` query rows (a multiple of kRowStep), keys of Dh values, values of Dp.
struct Scratch {
  std::vector<float> qt, acc, st, m, l, alpha, kf, vf;
  std::vector<uint16_t> qp, vp;
  std::vector<uint32_t> pp;
  Scratch(int rows, int Dh, int Dp)
      : qt(size_t(rows) * Dh), acc(size_t(rows) * Dp), st(size_t(rows) * kKeyTile), m(rows), l(rows), alpha(rows),
        kf(size_t(kKeyTile) * Dh), vf(size_t(kKeyTile) * Dp), qp(size_t(rows) * Dh), vp(size_t(kKeyTile + 2) * Dp),
        pp(size_t(rows) * (kKeyTile / 2 + 1)) {}
};

// A key tile's K and V in the form the path's products read, when made once for all tasks (the shared
// prefix): K widened to fp32 (or in place), V widened to fp32 rows of Dp, or V packed in bf16 pairs.
struct Prepared {
  const float* k;
  int64_t k_ld;
  const float* v;
  int64_t v_ld;
  const uint16_t* vp;
};

inline uint16_t bits(float) { return 0; }  // unused: only bf16 inputs take the bf16 dot product
inline uint16_t bits(c10::BFloat16 x) { return x.x; }

// n rows of Dh values at stride `stride` as fp32 rows of `width` >= Dh, zeros past Dh (fp32 rows of
// Dh values are read in place). `buffer`'s columns past Dh must be zero already.
template <typename T>
const float* widen(const T* src, int64_t stride, int n, int Dh, int width, float* buffer, int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    if (width == Dh) {
      *ld = stride;
      return src;
    }
  }
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < Dh; ++d) buffer[j * width + d] = static_cast<float>(src[j * stride + d]);
  *ld = width;
  return buffer;
}

// A key tile of the shared prefix: its K and V rows' offsets in the pools (KV head 0) and its keys.
struct PrefixTile {
  int64_t k_off, v_off;
  int n;
};

// fp32 rows as the products read them in place; null for bf16 rows (those are widened or packed first).
template <typename T>
const float* as_float_rows(const T* rows) {
  if constexpr (std::is_same_v<T, float>)
    return rows;
  else
    return nullptr;
}

template <typename T>
struct TaskRunner {
  const Args<T>& a;
  const Ops& ops;
  Scratch& sc;
  bool bf16_dot;
  bool pairs;    // P V by the path's bf16 product (bf16 inputs on a path with one)
  bool columns;  // acc kept transposed, [Dp][Rp] (the path's choice for its bf16 product)

  // One tile of nk keys (rows `kb`, `vb` of stride ks, vs; `prep`: the same made ready, or null), Rp rows:
  // scores, causal mask, softmax, P V.
  void tile(const Task& t, int Rp, const T* kb, int64_t ks, const T* vb, int64_t vs, int nk, int64_t causal_j0,
            const Prepared* prep) {
    const int Dh = a.Dh, Dp = a.Dp;
    float* St = sc.st.data();
    if (bf16_dot) {
      ops.scores_bf16(reinterpret_cast<const uint16_t*>(kb), ks, sc.qp.data(), St, nk, Rp, Dh);
    } else {
      int64_t ldk = prep ? prep->k_ld : 0;
      const float* K = prep ? prep->k : widen(kb, ks, nk, Dh, Dh, sc.kf.data(), &ldk);
      ops.gemm(K, ldk, 1, sc.qt.data(), Rp, St, Rp, nk, Rp, Dh, false);
    }
    if (causal_j0 >= 0 && causal_j0 + nk - 1 > t.q0) {  // own keys past some row's position
      // Key j is past the position of rows r < (causal_j0 + j - q0) x group (positions before it).
      for (int j = 0; j < nk; ++j) {
        const int64_t upto = std::min<int64_t>(Rp, (causal_j0 + j - t.q0) * a.group);
        if (upto > 0) std::fill(St + int64_t(j) * Rp, St + int64_t(j) * Rp + upto, kNegInf);
      }
    }
    // bf16 scores are scaled in the softmax; fp32 ones came from queries scaled when loaded.
    const float scale = bf16_dot ? a.scale : 1.f;
    if (pairs) {  // P rounded to bf16 against V, in pairs of keys
      ops.softmax(St, nk, Rp, scale, sc.m.data(), sc.l.data(), sc.alpha.data(), sc.acc.data(), Dp, sc.pp.data());
      const uint16_t* Vp = prep ? prep->vp : sc.vp.data();
      if (!prep) ops.pack_v(reinterpret_cast<const uint16_t*>(vb), vs, sc.vp.data(), nk, Dh, Dp);
      ops.pv_bf16(sc.pp.data(), Vp, sc.acc.data(), nk, Rp, Dp);
      return;
    }
    ops.softmax(St, nk, Rp, scale, sc.m.data(), sc.l.data(), sc.alpha.data(), sc.acc.data(), Dp, nullptr);
    int64_t ldv = prep ? prep->v_ld : 0;
    const float* V = prep ? prep->v : widen(vb, vs, nk, Dh, Dp, sc.vf.data(), &ldv);
    ops.gemm(St, 1, Rp, V, ldv, sc.acc.data(), Dp, Rp, Dp, nk, true);
  }

  // n keys from `kb` / `vb`; causal: they are the piece's own keys (key j at position j).
  void keys(const Task& t, int Rp, const T* kb, int64_t ks, const T* vb, int64_t vs, int64_t n, bool causal) {
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile)
      tile(t, Rp, kb + j0 * ks, ks, vb + j0 * vs, vs, int(std::min<int64_t>(kKeyTile, n - j0)), causal ? j0 : -1,
           nullptr);
  }

  // Q^T [Dh][Rp] scaled (fp32 scores) or Q in bf16 pairs [Dh / 2][Rp][2] (bf16 dot); padded rows 0.
  void load_q(const Task& t, int Rp, int64_t q_start) {
    const int G = a.group, Dh = a.Dh, R = int(t.nq) * G;
    std::fill(sc.qt.begin(), sc.qt.begin() + size_t(Rp) * Dh, 0.f);
    std::fill(sc.qp.begin(), sc.qp.begin() + size_t(Rp) * Dh, uint16_t(0));
    for (int r = 0; r < R; ++r) {
      const T* src = a.q + (q_start + t.q0 + r / G) * a.q_row + (t.head * G + r % G) * a.q_head;
      for (int d = 0; d < Dh; ++d) {
        if (bf16_dot)
          sc.qp[(d / 2 * Rp + r) * 2 + d % 2] = bits(src[d]);
        else
          sc.qt[d * Rp + r] = static_cast<float>(src[d]) * a.scale;
      }
    }
  }

  // The task's queries against every key they see: the shared prefix's tiles (`prefix`, offsets from KV
  // head 0; `prepared`: those tiles made ready once per call, or empty), visible ranges, own keys.
  void run(const Task& t, const std::vector<PrefixTile>& prefix, const std::vector<Prepared>& prepared) {
    const int G = a.group, Dh = a.Dh, Dp = a.Dp, R = int(t.nq) * G, Rp = (R + kRowStep - 1) / kRowStep * kRowStep;
    const int64_t* p = a.pieces + 5 * t.piece;
    const int64_t q_start = p[0], k_start = p[1];
    load_q(t, Rp, q_start);
    std::fill(sc.m.begin(), sc.m.begin() + Rp, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + Rp, 0.f);
    std::fill(sc.acc.begin(), sc.acc.begin() + size_t(Rp) * Dp, 0.f);
    for (size_t i = 0; i < prefix.size(); ++i) {
      const PrefixTile& pt = prefix[i];
      tile(t, Rp, a.pool_k + pt.k_off + t.head * a.pk_head, a.pk_row, a.pool_v + pt.v_off + t.head * a.pv_head,
           a.pv_row, pt.n, -1, prepared.empty() ? nullptr : &prepared[t.head * prefix.size() + i]);
    }
    for (int64_t i = p[3]; i < p[4]; ++i) {
      const int64_t begin = a.visible[2 * i], end = a.visible[2 * i + 1];
      keys(t, Rp, a.k + begin * a.k_row + t.head * a.k_head, a.k_row, a.v + begin * a.v_row + t.head * a.v_head,
           a.v_row, end - begin, false);
    }
    keys(t, Rp, a.k + k_start * a.k_row + t.head * a.k_head, a.k_row, a.v + k_start * a.v_row + t.head * a.v_head,
         a.v_row, t.q0 + t.nq, true);
    const int64_t row_step = columns ? 1 : Dp, col_step = columns ? Rp : 1;
    for (int r = 0; r < R; ++r) {
      T* dst = a.q + (q_start + t.q0 + r / G) * a.q_row + (t.head * G + r % G) * a.q_head;
      const float inv = 1.f / sc.l[r];
      for (int d = 0; d < Dh; ++d) dst[d] = static_cast<T>(sc.acc[r * row_step + d * col_step] * inv);
    }
  }
};

// The shared prefix's key tiles in order: block by block, kKeyTile keys at a time.
template <typename T>
std::vector<PrefixTile> prefix_tiles(const Args<T>& a) {
  std::vector<PrefixTile> tiles;
  if (!a.pool_k) return tiles;
  for (int64_t b = 0; b < a.num_ids; ++b) {
    const int64_t n = std::min(a.block_tokens, a.prefix_tokens - b * a.block_tokens), id = a.block_ids[b];
    if (n <= 0) break;
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile)
      tiles.push_back({id * a.pk_block + j0 * a.pk_row, id * a.pv_block + j0 * a.pv_row,
                       int(std::min<int64_t>(kKeyTile, n - j0))});
  }
  return tiles;
}

// The prefix's tiles per KV head in the form the path's products read ([head][tile]), made once for every
// task instead of once per task; the buffers hold what had to be converted.
struct PreparedPrefix {
  std::vector<float> k, v;
  std::vector<uint16_t> vp;
  std::vector<Prepared> tiles;
};

template <typename T>
void prepare_prefix(const Args<T>& a, const Ops& ops, bool bf16_dot, const std::vector<PrefixTile>& tiles,
                    int64_t num_kv_heads, PreparedPrefix& out) {
  const int64_t n = num_kv_heads * int64_t(tiles.size());
  const bool pairs = bf16_dot && ops.pv_bf16;
  const bool widen_k = !bf16_dot && !std::is_same_v<T, float>;
  const bool widen_v = !pairs && !(std::is_same_v<T, float> && a.Dp == a.Dh);
  if (widen_k) out.k.resize(size_t(n) * kKeyTile * a.Dh);
  if (widen_v) out.v.resize(size_t(n) * kKeyTile * a.Dp);
  if (pairs) out.vp.resize(size_t(n) * (kKeyTile + 2) * a.Dp);
  out.tiles.resize(size_t(n));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PrefixTile& pt = tiles[size_t(i % int64_t(tiles.size()))];
      const int64_t head = i / int64_t(tiles.size());
      const T* kb = a.pool_k + pt.k_off + head * a.pk_head;
      const T* vb = a.pool_v + pt.v_off + head * a.pv_head;
      Prepared& p = out.tiles[size_t(i)];
      p = {as_float_rows(kb), a.pk_row, as_float_rows(vb), a.pv_row, nullptr};
      if (widen_k) p.k = widen(kb, a.pk_row, pt.n, a.Dh, a.Dh, out.k.data() + i * kKeyTile * a.Dh, &p.k_ld);
      if (widen_v) p.v = widen(vb, a.pv_row, pt.n, a.Dh, a.Dp, out.v.data() + i * kKeyTile * a.Dp, &p.v_ld);
      if (pairs) {
        uint16_t* vp = out.vp.data() + i * (kKeyTile + 2) * a.Dp;
        ops.pack_v(reinterpret_cast<const uint16_t*>(vb), a.pv_row, vp, pt.n, a.Dh, a.Dp);
        p.vp = vp;
      }
    }
  });
}

template <typename T>
void run_all(const Args<T>& a, const Ops& ops, int64_t num_pieces, int64_t num_kv_heads) {
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_pieces; ++i) {
    const int64_t* p = a.pieces + 5 * i;
    int64_t shared = a.pool_k ? a.prefix_tokens : 0;
    for (int64_t v = p[3]; v < p[4]; ++v) shared += a.visible[2 * v + 1] - a.visible[2 * v];
    for (int64_t q0 = 0; q0 < p[2]; q0 += a.rows_per_block)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t nq = std::min<int64_t>(a.rows_per_block, p[2] - q0);
        tasks.push_back({i, h, q0, nq, nq * (shared + q0 + nq)});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  const bool bf16_dot = ops.scores_bf16 != nullptr && std::is_same_v<T, c10::BFloat16>;
  const std::vector<PrefixTile> prefix = prefix_tiles(a);
  // Made ready once when more than one task per KV head reads the prefix and the copy stays small.
  PreparedPrefix prepared;
  const int64_t copy_bytes = num_kv_heads * int64_t(prefix.size()) * kKeyTile * (a.Dh + a.Dp) * 4;
  if (!prefix.empty() && int64_t(tasks.size()) > num_kv_heads && copy_bytes <= kPrepareBytes)
    prepare_prefix(a, ops, bf16_dot, prefix, num_kv_heads, prepared);
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = int64_t(tasks.size());
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks)), 1,
                   [&](int64_t, int64_t) {
                     Scratch sc((a.rows_per_block * a.group + kRowStep - 1) / kRowStep * kRowStep, a.Dh, a.Dp);
                     const bool pairs = bf16_dot && ops.pv_bf16;
                     TaskRunner<T> runner{a, ops, sc, bf16_dot, pairs, pairs && ops.acc_columns};
                     if (ops.thread_begin) ops.thread_begin();
                     for (int64_t i; (i = next.fetch_add(1)) < num_tasks;) runner.run(tasks[i], prefix, prepared.tiles);
                     if (ops.thread_end) ops.thread_end();
                   });
}

// ---- the op --------------------------------------------------------------------------------------

void check_rows(const at::Tensor& t, const char* name, int64_t heads, int64_t Dh, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == Dh, "native attention: ", name,
              " must be [*, ", heads, ", ", Dh, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype && t.stride(2) == 1 && t.device().is_cpu(), "native attention: ", name,
              " must be a CPU tensor of q's dtype with unit stride in its last dim");
}

template <typename T>
Args<T> make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pieces,
                  const at::Tensor& visible, const std::optional<at::Tensor>& pool_k,
                  const std::optional<at::Tensor>& pool_v, const std::optional<at::Tensor>& ids, int64_t prefix_tokens,
                  int column_step) {
  const int64_t Dh = q.size(2), group = q.size(1) / k.size(1);
  Args<T> a{};
  a.q = q.data_ptr<T>(), a.q_row = q.stride(0), a.q_head = q.stride(1);
  a.k = k.const_data_ptr<T>(), a.k_row = k.stride(0), a.k_head = k.stride(1);
  a.v = v.const_data_ptr<T>(), a.v_row = v.stride(0), a.v_head = v.stride(1);
  if (pool_k && prefix_tokens > 0) {
    a.pool_k = pool_k->const_data_ptr<T>(), a.pool_v = pool_v->const_data_ptr<T>();
    a.pk_block = pool_k->stride(0), a.pk_row = pool_k->stride(1), a.pk_head = pool_k->stride(2);
    a.pv_block = pool_v->stride(0), a.pv_row = pool_v->stride(1), a.pv_head = pool_v->stride(2);
    a.block_ids = ids->const_data_ptr<int64_t>(), a.num_ids = ids->numel();
    a.block_tokens = pool_k->size(1), a.prefix_tokens = prefix_tokens;
  }
  a.pieces = pieces.const_data_ptr<int64_t>(), a.visible = visible.const_data_ptr<int64_t>();
  a.group = int(group), a.Dh = int(Dh), a.rows_per_block = int(std::max<int64_t>(1, kRowsPerTask / group));
  a.Dp = int((Dh + column_step - 1) / column_step * column_step);
  a.scale = float(1.0 / std::sqrt(double(Dh))) * kLog2e;
  return a;
}

void check_prefix(const at::Tensor& pool_k, const at::Tensor& pool_v, const at::Tensor& ids, int64_t prefix_tokens,
                  int64_t kv_heads, int64_t Dh, at::ScalarType dtype) {
  for (const auto* t : {&pool_k, &pool_v}) {
    TORCH_CHECK(t->dim() == 4 && t->size(2) == kv_heads && t->size(3) == Dh && t->sizes() == pool_k.sizes(),
                "native attention: the prefix pools must be [blocks, block_tokens, ", kv_heads, ", ", Dh, "]");
    TORCH_CHECK(t->scalar_type() == dtype && t->stride(3) == 1 && t->device().is_cpu(),
                "native attention: the prefix pools must be CPU tensors of q's dtype, unit stride in the last dim");
  }
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "native attention: block_ids must be a contiguous int64 CPU vector");
  TORCH_CHECK(prefix_tokens <= ids.numel() * pool_k.size(1), "native attention: ", prefix_tokens,
              " prefix tokens do not fit in ", ids.numel(), " blocks of ", pool_k.size(1));
  const int64_t* p = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < pool_k.size(0), "native attention: block id ", p[i], " is not in the pool");
}

void check_pieces(const at::Tensor& pieces, const at::Tensor& visible, int64_t num_q, int64_t num_k) {
  TORCH_CHECK(pieces.dim() == 2 && pieces.size(1) == 5 && pieces.scalar_type() == at::kLong &&
                  pieces.is_contiguous() && visible.dim() == 2 && visible.size(1) == 2 &&
                  visible.scalar_type() == at::kLong && visible.is_contiguous(),
              "native attention: pieces must be int64 [n, 5] and visible int64 [m, 2], contiguous");
  const int64_t* p = pieces.const_data_ptr<int64_t>();
  const int64_t* vis = visible.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < pieces.size(0); ++i, p += 5) {
    TORCH_CHECK(p[2] >= 0 && p[0] >= 0 && p[0] + p[2] <= num_q && p[1] >= 0 && p[1] + p[2] <= num_k,
                "native attention: piece ", i, " reaches past q or k");
    TORCH_CHECK(0 <= p[3] && p[3] <= p[4] && p[4] <= visible.size(0), "native attention: piece ", i,
                " names visible ranges that do not exist");
    for (int64_t j = p[3]; j < p[4]; ++j)
      TORCH_CHECK(0 <= vis[2 * j] && vis[2 * j] <= vis[2 * j + 1] && vis[2 * j + 1] <= num_k,
                  "native attention: visible range ", j, " reaches past k");
  }
}

// Returns the name of the path that ran.
std::string attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pieces,
                   const at::Tensor& visible, const std::optional<at::Tensor>& pool_k,
                   const std::optional<at::Tensor>& pool_v, const std::optional<at::Tensor>& block_ids,
                   int64_t prefix_tokens, std::string isa) {
  TORCH_CHECK(q.dim() == 3, "native attention: q must be [L, H, Dh]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "native attention: float32 or bfloat16 only, got ", q.scalar_type());
  const int64_t H = q.size(1), Dh = q.size(2), Hkv = k.dim() == 3 ? k.size(1) : 0;
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "native attention: k must be [N, Hkv, Dh] with Hkv dividing H = ", H);
  check_rows(q, "q", H, Dh, q.scalar_type());
  check_rows(k, "k", Hkv, Dh, q.scalar_type());
  check_rows(v, "v", Hkv, Dh, q.scalar_type());
  TORCH_CHECK(v.size(0) == k.size(0), "native attention: k and v differ in rows");
  check_pieces(pieces, visible, q.size(0), k.size(0));
  const bool has_prefix = pool_k.has_value() && prefix_tokens > 0;
  if (has_prefix) {
    TORCH_CHECK(pool_v.has_value() && block_ids.has_value(), "native attention: a prefix needs pool_v and block_ids");
    check_prefix(*pool_k, *pool_v, *block_ids, prefix_tokens, Hkv, Dh, q.scalar_type());
  }
  const Ops* ops = choose_ops(isa, int(Dh));
  if (q.scalar_type() == at::kFloat)
    run_all(make_args<float>(q, k, v, pieces, visible, pool_k, pool_v, block_ids, prefix_tokens, ops->column_step), *ops,
            pieces.size(0), Hkv);
  else
    run_all(make_args<c10::BFloat16>(q, k, v, pieces, visible, pool_k, pool_v, block_ids, prefix_tokens,
                                     ops->column_step), *ops,
            pieces.size(0), Hkv);
  return ops->name;
}

// The paths this CPU runs, best first, comma-separated.
std::string isas() {
  std::string out;
  for (const char* name : kPaths)
    if (ops_named(name) && cpu_runs(name)) out += (out.empty() ? "" : ",") + std::string(name);
  return out;
}

}  // namespace

TORCH_LIBRARY(tiered_native, m) {
  m.def(
      "attend_(Tensor(a!) q, Tensor k, Tensor v, Tensor pieces, Tensor visible, Tensor? pool_k, Tensor? pool_v, "
      "Tensor? block_ids, int prefix_tokens, str isa) -> str");
  m.def("isas() -> str", &isas);
}

TORCH_LIBRARY_IMPL(tiered_native, CPU, m) { m.impl("attend_", &attend); }
