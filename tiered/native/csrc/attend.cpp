// The `native` attention kernel of tiered: every piece's attention in one call.
//
// Contract (tiered/hybrid/attention/kernels.py, native.py): q [L, H, Dh] is overwritten with
// softmax(q k^T / sqrt(Dh)) v, where each query of a piece sees (1) the shared prefix, read from
// a pool [blocks, block_tokens, Hkv, Dh] through a block-id list, (2) its piece's visible key
// ranges, (3) its own keys causally. GQA: the H / Hkv query heads of a KV head form a group.
// Positions run in that order (the prefix from 0, then the visible ranges, then the own keys); with a
// sliding window W > 0 a query at position p sees only the keys at positions above p - W, and a key
// tile wholly below every window of a query block is skipped.
//
// Work: one task = (piece, KV head, consecutive blocks of query positions); a block's rows are its
// positions x the group's heads, so every K/V tile is loaded (and converted from bf16) once for
// the whole group, and made ready for the products (widened, or V packed in pairs) once for all the
// task's blocks. Per key tile and block: S = Q K^T (a small GEMM against K packed transposed), an
// online fp32 softmax in base 2 (log2(e) folded into the scores' scale), acc += P V. Tasks are handed
// out largest first from an atomic counter inside at::parallel_for (causal blocks differ in cost).
// The shared prefix's tiles are converted (widened to fp32 or packed in bf16 pairs) once per call
// for all tasks, when more than one block per KV head reads them and the copy stays small (a few MiB).
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
  int64_t window;  // 0: none; else a query at position p sees keys at positions p - window + 1 .. p
  int Dp;          // the width of values and outputs inside the kernel: Dh rounded up to the path's column step
  float scale;  // 1 / sqrt(Dh) x log2(e)
};

struct Task {
  int64_t piece, head, q0, nq, cost;  // positions q0 .. q0 + nq of the piece: consecutive query blocks
};

// A thread's buffers: per query block (at most `blocks` a task, `rows` rows each, a multiple of kRowStep) its
// queries, accumulator and softmax state; per key tile the scores, P and the tile's K, V made ready.
struct Scratch {
  int rows;
  std::vector<float> qt, acc, m, l, alpha, st, kf, vf;
  std::vector<uint16_t> qp, vp;
  std::vector<uint32_t> pp;
  Scratch(int blocks, int rows, int Dh, int Dp)
      : rows(rows),
        qt(size_t(blocks) * rows * Dh),
        acc(size_t(blocks) * rows * Dp),
        m(size_t(blocks) * rows),
        l(size_t(blocks) * rows),
        alpha(size_t(blocks) * rows),
        st(size_t(rows) * kKeyTile),
        kf(size_t(kKeyTile) * Dh),
        vf(size_t(kKeyTile) * Dp),
        qp(size_t(blocks) * rows * Dh),
        vp(size_t(kKeyTile + 2) * Dp),
        pp(size_t(rows) * (kKeyTile / 2 + 1)) {}
};

// A key tile's K and V in the form the path's products read: K widened to fp32 (or in place; unused by the
// bf16 dot, which reads K's rows), V widened to fp32 rows of Dp, or V packed in bf16 pairs.
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

// A key tile of the shared prefix: its K and V rows' offsets in the pools (KV head 0), its keys and
// the position of its first.
struct PrefixTile {
  int64_t k_off, v_off;
  int n;
  int64_t pos;
};

// fp32 rows as the products read them in place; null for bf16 rows (those are widened or packed first).
template <typename T>
const float* as_float_rows(const T* rows) {
  if constexpr (std::is_same_v<T, float>)
    return rows;
  else
    return nullptr;
}

// One query block of a task: its positions, padded rows and state in the thread's buffers.
struct Block {
  int64_t q0, nq;
  int R, Rp;
  float *qt, *acc, *m, *l, *alpha;
  uint16_t* qp;
};

template <typename T>
struct TaskRunner {
  const Args<T>& a;
  const Ops& ops;
  Scratch& sc;
  bool bf16_dot;
  bool pairs;    // P V by the path's bf16 product (bf16 inputs on a path with one)
  bool columns;  // acc kept transposed, [Dp][Rp] (the path's choice for its bf16 product)
  int64_t before = 0;  // the running task's piece: the position of its first own key (keys ahead of it)

  // Block b of task t: rows_per_block positions from t.q0 + b x rows_per_block (fewer at the task's end).
  Block block(const Task& t, int b) const {
    const int64_t q0 = t.q0 + int64_t(b) * a.rows_per_block, nq = std::min<int64_t>(a.rows_per_block, t.q0 + t.nq - q0);
    const int R = int(nq) * a.group, Rp = (R + kRowStep - 1) / kRowStep * kRowStep;
    const size_t rows = size_t(b) * sc.rows;
    return {q0,
            nq,
            R,
            Rp,
            sc.qt.data() + rows * a.Dh,
            sc.acc.data() + rows * a.Dp,
            sc.m.data() + rows,
            sc.l.data() + rows,
            sc.alpha.data() + rows,
            sc.qp.data() + rows * a.Dh};
  }

  // A tile's K and V made ready for every block of the task: `prep` where made once per call, else here.
  Prepared ready(const T* kb, int64_t ks, const T* vb, int64_t vs, int nk, const Prepared* prep) {
    if (prep) return *prep;
    Prepared p{nullptr, 0, nullptr, 0, nullptr};
    if (!bf16_dot) p.k = widen(kb, ks, nk, a.Dh, a.Dh, sc.kf.data(), &p.k_ld);
    if (pairs) {
      ops.pack_v(reinterpret_cast<const uint16_t*>(vb), vs, sc.vp.data(), nk, a.Dh, a.Dp);
      p.vp = sc.vp.data();
    } else {
      p.v = widen(vb, vs, nk, a.Dh, a.Dp, sc.vf.data(), &p.v_ld);
    }
    return p;
  }

  // Whether a window hides every key of a tile whose last key is at position `last` from every row of a
  // block whose first query is at `first` (the first query sees the most of the earlier keys).
  bool out_of_window(int64_t first, int64_t last) const { return a.window > 0 && last <= first - a.window; }

  // One block against one tile of nk keys (K rows `kb` of stride ks; `p`: the tile made ready; `kpos`: the
  // position of its first key): scores, causal mask (causal_j0 >= 0: the tile's keys are the piece's own, the
  // first at the piece's own position causal_j0), window mask, softmax, P V.
  void step(const Block& b, const T* kb, int64_t ks, int nk, int64_t causal_j0, int64_t kpos, const Prepared& p) {
    const int Dh = a.Dh, Dp = a.Dp, Rp = b.Rp;
    float* St = sc.st.data();
    if (bf16_dot)
      ops.scores_bf16(reinterpret_cast<const uint16_t*>(kb), ks, b.qp, St, nk, Rp, Dh);
    else
      ops.gemm(p.k, p.k_ld, 1, b.qt, Rp, St, Rp, nk, Rp, Dh, false);
    if (causal_j0 >= 0 && causal_j0 + nk - 1 > b.q0) {  // own keys past some row's position
      // Key j is past the position of rows r < (causal_j0 + j - q0) x group (positions before it).
      for (int j = 0; j < nk; ++j) {
        const int64_t upto = std::min<int64_t>(Rp, (causal_j0 + j - b.q0) * a.group);
        if (upto > 0) std::fill(St + int64_t(j) * Rp, St + int64_t(j) * Rp + upto, kNegInf);
      }
    }
    if (a.window > 0 && kpos + a.window <= before + b.q0 + b.nq - 1) {  // some row's window starts past a key
      // Key j is outside the window of rows r >= (kpos + j + window - first query's position) x group.
      for (int j = 0; j < nk; ++j) {
        const int64_t from = std::max<int64_t>(0, (kpos + j + a.window - before - b.q0) * a.group);
        if (from < Rp) std::fill(St + int64_t(j) * Rp + from, St + int64_t(j) * Rp + Rp, kNegInf);
      }
    }
    // bf16 scores are scaled in the softmax; fp32 ones came from queries scaled when loaded.
    const float scale = bf16_dot ? a.scale : 1.f;
    ops.softmax(St, nk, Rp, scale, b.m, b.l, b.alpha, b.acc, Dp, pairs ? sc.pp.data() : nullptr);
    if (pairs)
      ops.pv_bf16(sc.pp.data(), p.vp, b.acc, nk, Rp, Dp);
    else
      ops.gemm(St, 1, Rp, p.v, p.v_ld, b.acc, Dp, Rp, Dp, nk, true);
  }

  // Whether block b sees a key of a tile of nk keys from position kpos (causal_j0: as in `step`).
  bool sees(const Block& b, int nk, int64_t causal_j0, int64_t kpos) const {
    return (causal_j0 < 0 || causal_j0 <= b.q0 + b.nq - 1) && !out_of_window(before + b.q0, kpos + nk - 1);
  }

  // One tile for every block of the task that sees one of its keys (causal: a block before the tile's first
  // key sees none; windowed: nor one whose windows all start past its last); its K and V are made ready once for
  // all of them, and not at all when the task's first block (which sees the most of the earlier keys) sees none.
  void tile(const Task& t, const T* kb, int64_t ks, const T* vb, int64_t vs, int nk, int64_t causal_j0,
            int64_t kpos, const Prepared* prep) {
    if (out_of_window(before + t.q0, kpos + nk - 1)) return;
    const Prepared p = ready(kb, ks, vb, vs, nk, prep);
    const int num_blocks = int((t.nq + a.rows_per_block - 1) / a.rows_per_block);
    for (int i = 0; i < num_blocks; ++i) {
      const Block b = block(t, i);
      if (sees(b, nk, causal_j0, kpos)) step(b, kb, ks, nk, causal_j0, kpos, p);
    }
  }

  // n keys from `kb` / `vb`, the first at position kpos; causal: they are the piece's own keys (key j at the
  // piece's own position j).
  void keys(const Task& t, const T* kb, int64_t ks, const T* vb, int64_t vs, int64_t n, bool causal, int64_t kpos) {
    for (int64_t j0 = 0; j0 < n; j0 += kKeyTile)
      tile(t, kb + j0 * ks, ks, vb + j0 * vs, vs, int(std::min<int64_t>(kKeyTile, n - j0)), causal ? j0 : -1,
           kpos + j0, nullptr);
  }

  // Q^T [Dh][Rp] scaled (fp32 scores) or Q in bf16 pairs [Dh / 2][Rp][2] (bf16 dot); padded rows 0. The
  // softmax state and acc start empty.
  void start(const Block& b, int64_t head, int64_t q_start) {
    const int G = a.group, Dh = a.Dh, Rp = b.Rp;
    std::fill(b.qt, b.qt + size_t(Rp) * Dh, 0.f);
    std::fill(b.qp, b.qp + size_t(Rp) * Dh, uint16_t(0));
    for (int r = 0; r < b.R; ++r) {
      const T* src = a.q + (q_start + b.q0 + r / G) * a.q_row + (head * G + r % G) * a.q_head;
      for (int d = 0; d < Dh; ++d) {
        if (bf16_dot)
          b.qp[(d / 2 * Rp + r) * 2 + d % 2] = bits(src[d]);
        else
          b.qt[d * Rp + r] = static_cast<float>(src[d]) * a.scale;
      }
    }
    std::fill(b.m, b.m + Rp, kNegInf);
    std::fill(b.l, b.l + Rp, 0.f);
    std::fill(b.acc, b.acc + size_t(Rp) * a.Dp, 0.f);
  }

  // acc / l written over the block's queries.
  void finish(const Block& b, int64_t head, int64_t q_start) {
    const int G = a.group, Dh = a.Dh;
    const int64_t row_step = columns ? 1 : a.Dp, col_step = columns ? b.Rp : 1;
    for (int r = 0; r < b.R; ++r) {
      T* dst = a.q + (q_start + b.q0 + r / G) * a.q_row + (head * G + r % G) * a.q_head;
      const float inv = 1.f / b.l[r];
      for (int d = 0; d < Dh; ++d) dst[d] = static_cast<T>(b.acc[r * row_step + d * col_step] * inv);
    }
  }

  // The task's queries against every key they see: the shared prefix's tiles (`prefix`, offsets from KV
  // head 0; `prepared`: those tiles made ready once per call, or empty), visible ranges, own keys.
  void run(const Task& t, const std::vector<PrefixTile>& prefix, const std::vector<Prepared>& prepared) {
    const int64_t* p = a.pieces + 5 * t.piece;
    const int64_t q_start = p[0], k_start = p[1];
    const int64_t prefix_tokens = a.pool_k ? a.prefix_tokens : 0;
    before = prefix_tokens;
    for (int64_t i = p[3]; i < p[4]; ++i) before += a.visible[2 * i + 1] - a.visible[2 * i];
    const int num_blocks = int((t.nq + a.rows_per_block - 1) / a.rows_per_block);
    for (int i = 0; i < num_blocks; ++i) start(block(t, i), t.head, q_start);
    if (prepared.empty()) {
      for (const PrefixTile& pt : prefix)
        tile(t, a.pool_k + pt.k_off + t.head * a.pk_head, a.pk_row, a.pool_v + pt.v_off + t.head * a.pv_head,
             a.pv_row, pt.n, -1, pt.pos, nullptr);
    } else {  // tiles made ready already: block by block, so one block's state stays in cache over them all
      for (int b = 0; b < num_blocks; ++b) {
        const Block blk = block(t, b);
        for (size_t i = 0; i < prefix.size(); ++i)
          if (sees(blk, prefix[i].n, -1, prefix[i].pos))
            step(blk, a.pool_k + prefix[i].k_off + t.head * a.pk_head, a.pk_row, prefix[i].n, -1, prefix[i].pos,
                 prepared[t.head * prefix.size() + i]);
      }
    }
    int64_t kpos = prefix_tokens;
    for (int64_t i = p[3]; i < p[4]; ++i) {
      const int64_t begin = a.visible[2 * i], end = a.visible[2 * i + 1];
      keys(t, a.k + begin * a.k_row + t.head * a.k_head, a.k_row, a.v + begin * a.v_row + t.head * a.v_head, a.v_row,
           end - begin, false, kpos);
      kpos += end - begin;
    }
    keys(t, a.k + k_start * a.k_row + t.head * a.k_head, a.k_row, a.v + k_start * a.v_row + t.head * a.v_head, a.v_row,
         t.q0 + t.nq, true, before);
    for (int i = 0; i < num_blocks; ++i) finish(block(t, i), t.head, q_start);
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
                       int(std::min<int64_t>(kKeyTile, n - j0)), b * a.block_tokens + j0});
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
  const bool bf16_dot = ops.scores_bf16 != nullptr && std::is_same_v<T, c10::BFloat16>;
  const std::vector<PrefixTile> prefix = prefix_tiles(a);
  int64_t num_blocks = 0;
  for (int64_t i = 0; i < num_pieces; ++i)
    num_blocks += (a.pieces[5 * i + 2] + a.rows_per_block - 1) / a.rows_per_block * num_kv_heads;
  // The prefix's tiles are made ready once when more than one block per KV head reads them and the copy stays
  // within kPrepareBytes: a larger copy is one more pass over memory, then read from memory block by block by
  // every task, where unprepared, a long prefix's tiles are streamed once per task of many blocks (below) and
  // made ready there for all of them.
  PreparedPrefix prepared;
  const int64_t copy_bytes = num_kv_heads * int64_t(prefix.size()) * kKeyTile * (a.Dh + a.Dp) * 4;
  if (!prefix.empty() && num_blocks > num_kv_heads && copy_bytes <= kPrepareBytes)
    prepare_prefix(a, ops, bf16_dot, prefix, num_kv_heads, prepared);
  // Blocks per task: a task makes each tile it reads ready once for all its blocks, so a piece whose blocks read
  // mostly tiles not made ready above takes as many as keep kTasksPerThread tasks a thread (more tasks than
  // threads keep the threads evenly loaded), at most kBlocksPerTask; a piece whose keys are mostly the ready
  // prefix takes one (its blocks' state then stays in cache over the whole prefix).
  const int64_t grouped =
      std::clamp<int64_t>(num_blocks / (kTasksPerThread * int64_t(at::get_num_threads())), 1, kBlocksPerTask);
  const int64_t ready_keys = prepared.tiles.empty() ? 0 : a.prefix_tokens;
  const int64_t block_rows = (a.rows_per_block * a.group + kRowStep - 1) / kRowStep * kRowStep;  // padded
  std::vector<Task> tasks;
  int64_t most_blocks = 1;  // in one task
  for (int64_t i = 0; i < num_pieces; ++i) {
    const int64_t* p = a.pieces + 5 * i;
    int64_t shared = a.pool_k ? a.prefix_tokens : 0;
    for (int64_t v = p[3]; v < p[4]; ++v) shared += a.visible[2 * v + 1] - a.visible[2 * v];
    const int64_t piece_blocks = (p[2] + a.rows_per_block - 1) / a.rows_per_block;
    int64_t per_task = shared + p[2] - ready_keys >= ready_keys ? grouped : 1;
    // A piece whose keys not made ready hold more K,V per KV head than a core's cache reads them from memory once
    // per task: its blocks go in as few tasks as keep every thread busy (each KV head's split in
    // ceil(threads / KV heads)), as many a task as keep the blocks' state (acc, queries) in that cache. (A task
    // reads the made-ready prefix block by block, so grouping would not cut that traffic.)
    const int64_t streamed = (shared + p[2] - ready_keys) * 2 * a.Dh * int64_t(sizeof(T));
    if (streamed > kStreamBytes) {
      const int64_t splits = (int64_t(at::get_num_threads()) + num_kv_heads - 1) / num_kv_heads;
      const int64_t state_fits = std::max<int64_t>(1, kStreamBytes / (block_rows * (a.Dp + a.Dh) * 4));
      per_task = std::max(per_task, std::min(state_fits, (piece_blocks + splits - 1) / splits));
    }
    most_blocks = std::max(most_blocks, std::min(per_task, piece_blocks));
    for (int64_t q0 = 0; q0 < p[2]; q0 += per_task * a.rows_per_block)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t nq = std::min<int64_t>(per_task * a.rows_per_block, p[2] - q0);
        int64_t cost = 0;  // query-key pairs, block by block
        for (int64_t b0 = q0; b0 < q0 + nq; b0 += a.rows_per_block) {
          const int64_t bq = std::min<int64_t>(a.rows_per_block, q0 + nq - b0);
          cost += bq * (shared + b0 + bq);
        }
        tasks.push_back({i, h, q0, nq, cost});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = int64_t(tasks.size());
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks)), 1,
                   [&](int64_t, int64_t) {
                     Scratch sc(int(most_blocks), int(block_rows), a.Dh, a.Dp);
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
                  int64_t window, const Ops& ops) {
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
  a.window = window;
  a.group = int(group), a.Dh = int(Dh), a.rows_per_block = int(std::max<int64_t>(1, ops.rows_per_block / group));
  a.Dp = int((Dh + ops.column_step - 1) / ops.column_step * ops.column_step);
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
                   int64_t prefix_tokens, int64_t window, std::string isa) {
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
  TORCH_CHECK(window >= 0, "native attention: window must be >= 0 (0: none), got ", window);
  const bool has_prefix = pool_k.has_value() && prefix_tokens > 0;
  if (has_prefix) {
    TORCH_CHECK(pool_v.has_value() && block_ids.has_value(), "native attention: a prefix needs pool_v and block_ids");
    check_prefix(*pool_k, *pool_v, *block_ids, prefix_tokens, Hkv, Dh, q.scalar_type());
  }
  const Ops* ops = choose_ops(isa, int(Dh));
  if (q.scalar_type() == at::kFloat)
    run_all(make_args<float>(q, k, v, pieces, visible, pool_k, pool_v, block_ids, prefix_tokens, window, *ops),
            *ops,
            pieces.size(0), Hkv);
  else
    run_all(make_args<c10::BFloat16>(q, k, v, pieces, visible, pool_k, pool_v, block_ids, prefix_tokens, window, *ops),
            *ops,
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
      "Tensor? block_ids, int prefix_tokens, int window, str isa) -> str");
  m.def("isas() -> str", &isas);
}

TORCH_LIBRARY_IMPL(tiered_native, CPU, m) { m.impl("attend_", &attend); }
