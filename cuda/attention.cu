// paged_attention on the GPU (semantics: cc/paged_attention_params.h; the
// same results as cc/cpu/attention.cc): causal attention of each sequence's
// new tokens over its paged KV cache, for prefill, chunked prefill,
// prefix-cache hits and decode in one launch.
//
// Work items. One CTA per (query token, kv head, key partition): it serves all
// query heads of the kv head's GQA group at once (up to 8; larger groups are
// cut into slices), so every K/V row is read once per token. A token finds its
// sequence by a binary search over query_start_loc on the device (a decode
// batch hits at the first probe). The grid comes from tensor shapes only: the
// partition count from the widest context the block table can hold
// (max_blocks_per_seq * block_size) and the device's multiprocessor count; a
// CTA whose partition starts past its token's last key exits at once. Nothing
// is read back to the host, so the launch can be captured in a CUDA graph and
// replayed with other seq_lens / block_tables / query_start_loc contents.
//
// Split-K (flash-decoding). When a token's keys span several partitions, each
// CTA leaves (m, l, acc) -- running max and sum of exp2 in the log2 domain,
// and the unnormalized weighted sum of values, all fp32 -- in the workspace,
// and a second kernel merges them: out = sum_p 2^(m_p - M) acc_p / sum_p
// 2^(m_p - M) l_p. A token whose keys fit one partition is written directly
// and skipped by the merge.
//
// Two attention kernels share that decomposition:
// - tensor cores (CUDA sm_80+, bf16/fp16, head sizes 64/80/96/128/256, block
//   sizes that are multiples of 16, 16-byte aligned rows): a CTA of 4 warps,
//   each walking a contiguous share of the partition 16 keys a step with
//   mma.m16n8k16 (fp32 accumulate); the warps merge through shared memory, so
//   a decode batch keeps every multiprocessor busy without a split across
//   CTAs. Scores are S^T = K Q^T (16 keys x 8 heads): K rows are the A operand
//   read straight from global memory in 16-byte loads, which works because the
//   order of the head dims inside a dot product is free -- Q is loaded with
//   the same permutation. The probabilities become the B operand of O^T = V^T
//   P^T after one movmatrix transpose; V^T's A operand is built from 16-byte
//   row loads with byte permutes (the order of the dims of O^T is free too,
//   and undone when storing). Each step every lane has 16 independent 16-byte
//   loads in flight (K and V of 16 keys: 8 KB a warp at head size 128, 128 KB
//   for the 16 warps a multiprocessor holds), and the arithmetic is a few
//   dozen instructions per step, so the kernel streams the cache at memory
//   speed.
// - SIMT (everything else: fp32, other head and block sizes, unaligned rows,
//   ROCm): a 128-thread CTA walks 32-key tiles through shared memory.
//
// A float8 cache (e4m3, unit scale; --kv-cache-dtype fp8, sm_89+) goes to the
// tensor-core kernel only: it loads half the bytes and widens each pair of
// e4m3 values to fp16 exactly (one cvt), and multiplies in fp16 -- Q is
// rounded to fp16 once, the probabilities to fp16 instead of bf16. Decode
// reads the cache at memory speed, so half the bytes is about half the time.
//
// Numerics follow the CPU kernel: fp32 scores (q . k, then * scale), online
// softmax in fp32 (exp2 of log2-scaled scores), fp32 accumulation, one
// rounding of the output. The tensor-core path also rounds the probabilities
// to bf16/fp16 for the P V product (as FlashAttention does); the row sums use
// the fp32 values.

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/kernels.h"

namespace pagoda {
namespace gpu {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Partitions hold at least this many keys (fewer: the merge costs more than
// the parallelism gains) and a multiple of kPartitionAlign (both kernels' key
// steps divide it).
constexpr int64_t kMinPartition = 256;
constexpr int64_t kPartitionAlign = 64;
constexpr int64_t kMaxPartitions = 4096;
// Query heads one CTA serves at most (the N = 8 of the tensor-core tile).
constexpr int kMaxHeadsPerCta = 8;
// Tensor-core kernel: warps per CTA, and the CTAs per multiprocessor to aim
// for when choosing the split (what the registers let run at once: 16 warps
// of <= 128 registers a thread, up to head size 128).
constexpr int kMmaWarps = 4;
constexpr int kMmaCtasPerSm = 4;
// SIMT kernel: threads, keys per tile, CTAs per multiprocessor to aim for, and
// its dynamic shared memory budget (under the 48 KB default limit).
constexpr int kSimtThreads = 128;
constexpr int kSimtKeys = 32;
constexpr int kSimtCtasPerSm = 8;
constexpr int64_t kSimtSmemBytes = 44 * 1024;
// Merge kernel threads (a power of two: tree reductions).
constexpr int kReduceThreads = 256;

enum Kernel : int32_t { kSimtKernel = 0, kMmaKernel = 1 };

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Everything the kernels read, by value.
struct Args {
  void* out;
  int64_t out_stride;
  const void* query;
  int64_t query_stride;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  int64_t block_tables_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  // [num_tokens, num_heads, num_partitions, head_size] and [..., 2] (m, l).
  float* partial_acc;
  float* partial_ml;
  float scale_log2;  // scale * log2(e): scores in the log2 domain
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks;
  int max_context;  // block table columns * block_size (capped at INT_MAX)
  int group;        // query heads per kv head
  int slices;       // CTAs per (token, kv head): ceil(group / heads_per_cta)
  int heads_per_cta;
  int partition_size;
  int num_partitions;
  bool kv_fp8;  // the caches hold e4m3 (tensor-core kernel only)
};

// The sequence that owns query row `token`: the s with query_start_loc[s] <=
// token < query_start_loc[s + 1].
__device__ __forceinline__ int find_sequence(const int32_t* qsl, int num_seqs,
                                             int token) {
  // Decode batches (one new token per sequence): sequence `token`. Both
  // bounds are loaded before either is tested: one memory round trip.
  if (token < num_seqs) {
    const int begin = qsl[token], end = qsl[token + 1];
    if (begin <= token && token < end) return token;
  }
  int lo = 0, hi = num_seqs;  // the last s with qsl[s] <= token
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (qsl[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Keys (cache positions 0 .. kv_len-1) that query row `token` of sequence seq
// sees, clamped to what the block table can address.
__device__ __forceinline__ int visible_keys(const Args& a, int seq, int token) {
  const int q_end = a.query_start_loc[seq + 1];
  const int kv_len = a.seq_lens[seq] - (q_end - token) + 1;
  return min(max(kv_len, 0), a.max_context);
}

__device__ __forceinline__ int partitions_of(const Args& a, int kv_len) {
  return max(1, static_cast<int>(ceil_div(kv_len, a.partition_size)));
}

// One CTA's work.
struct Item {
  int token, seq, kv_head, head0, num_heads;  // query heads head0 ..
  int kv_len, k_begin, k_end, num_parts;      // keys [k_begin, k_end)
};

__device__ __forceinline__ void item_heads(const Args& a, int unit, Item& it) {
  const int per_token = a.num_kv_heads * a.slices;
  it.token = unit / per_token;
  const int r = unit - it.token * per_token;
  it.kv_head = r / a.slices;
  const int slice = r - it.kv_head * a.slices;
  it.head0 = it.kv_head * a.group + slice * a.heads_per_cta;
  it.num_heads = min(a.heads_per_cta, a.group - slice * a.heads_per_cta);
}

// The keys of the item; false when its partition is empty (nothing to do).
// Partition 0 always runs, so that every output row is written.
__device__ __forceinline__ bool item_keys(const Args& a, int part, Item& it) {
  it.seq = find_sequence(a.query_start_loc, a.num_seqs, it.token);
  it.kv_len = visible_keys(a, it.seq, it.token);
  it.num_parts = partitions_of(a, it.kv_len);
  it.k_begin = part * a.partition_size;
  it.k_end = min(it.k_begin + a.partition_size, it.kv_len);
  return part < it.num_parts;
}

// Index of (token, query head, partition) in the partial results.
__device__ __forceinline__ int64_t partial_index(const Args& a, int token,
                                                 int head, int part) {
  return (static_cast<int64_t>(token) * a.num_heads + head) *
             a.num_partitions + part;
}

__device__ __forceinline__ int clamp_block(int block, int num_blocks) {
  return min(max(block, 0), num_blocks - 1);
}

// ---------------------------------------------------------------------------
// Tensor-core kernel (CUDA, sm_80 and newer).
#if !PAGODA_HIP

// Loads of 16, 8 or 4 bytes as 32-bit words. K/V rows are read once: they
// bypass L1 (.nc: the cache does not change during the kernel).
template <int B>
__device__ __forceinline__ void load_stream(uint32_t* w, const void* p) {
  if constexpr (B == 16) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p));
  } else if constexpr (B == 8) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
        : "=r"(w[0]), "=r"(w[1])
        : "l"(p));
  } else if constexpr (B == 4) {
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
  } else {
    static_assert(B == 2, "16, 8, 4 or 2 bytes");
    uint16_t x;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(x) : "l"(p));
    w[0] = x;
  }
}

// Four e4m3 values as two fp16 pairs: bytes 0, 1 -> lo; bytes 2, 3 -> hi.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t x, uint32_t& lo,
                                                  uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{.reg .b16 l, h;\n"
      " mov.b32 {l, h}, %2;\n"
      " cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
#else
  lo = hi = 0;
  __trap();  // the host refuses a float8 cache below sm_89
#endif
}

template <int B>
__device__ __forceinline__ void load_words(uint32_t* w, const void* p) {
  if constexpr (B == 32) {
    load_words<16>(w, p);
    load_words<16>(w + 4, static_cast<const uint4*>(p) + 1);
  } else if constexpr (B == 16) {
    const uint4 u = *static_cast<const uint4*>(p);
    w[0] = u.x;
    w[1] = u.y;
    w[2] = u.z;
    w[3] = u.w;
  } else if constexpr (B == 8) {
    const uint2 u = *static_cast<const uint2*>(p);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = *static_cast<const uint32_t*>(p);
  }
}

template <int B>
__device__ __forceinline__ void store_words(void* p, const uint32_t* w) {
  if constexpr (B == 16) {
    *static_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (B == 8) {
    *static_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *static_cast<uint32_t*>(p) = w[0];
  }
}

// Two fp32 values as packed bf16/fp16 (lo in the low half), rounded to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __half>) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// d += a b for one m16n8k16 tile (A 16x16 row-major, B 16x8 column-major, in
// the PTX fragment layouts; fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1,
                                    uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the host launches this kernel only on sm_80 and newer
#endif
}

// Transpose of an 8x8 matrix of 16-bit values held as one m8n8 fragment.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
#else
  r = x;
  __trap();
#endif
  return r;
}

template <int B>
using Bytes = std::integral_constant<int, B>;

// How a lane (g = lane / 4, t = lane % 4) covers a head of D dims.
//   QK: the reduction dimension (head dims) in 16-dim k-steps. For key row
//     g / g + 8 (A operand) and query head g (B operand), lane t holds 8 dims
//     (one 16-byte load) per 32 dims: dims 32c + 8t .. +8 are words 4c .. 4c+3
//     and feed k-steps 2c (words 4c, 4c+1) and 2c+1 (4c+2, 4c+3); a last lone
//     k-step takes 4 dims (8 bytes) at 32c + 4t. So k-step i uses words 2i and
//     2i+1 of every operand.
//   PV: O^T rows (head dims) in 16-dim tiles. For value rows of keys 2t, 2t+1,
//     2t+8, 2t+9, lane g holds 8 dims (16 bytes) per 64: dims 64c + 8g + 2w,
//     +1 are word 4c + w, and word i is tile i (its low dim on row g, its high
//     dim on row g + 8). Remainders of 32 and 16 dims take 8 and 4 bytes.
// A float8 cache doubles the groups (QK 16 dims per lane per 64, PV 16 per
// 128), so that its loads are 16 bytes too; any such assignment works, as
// long as Q, K, V and the output use the same one.
template <int D>
struct Layout {
  static_assert(D % 16 == 0 && D >= 16, "head size: a multiple of 16");
  static constexpr int kQkWords = D / 8;   // per row, per lane
  static constexpr int kTiles = D / 16;    // QK k-steps = PV tiles = PV words
};

// f(Bytes<B>, first dim, first word) for each chunk of `lane` (of Lanes) over
// the D dims from Dim0: whole groups of Group dims, each lane taking Group /
// Lanes consecutive dims of each (B = 2 bytes a dim: the chunk's size in
// 16-bit values), then what remains in groups half as large.
template <int D, int Group, int Lanes, int Dim0 = 0, typename F>
__device__ __forceinline__ void for_chunks(int lane, F& f) {
  constexpr int kPerLane = Group / Lanes;
  static_assert(kPerLane >= 2, "a chunk holds at least one word");
#pragma unroll
  for (int c = 0; c < D / Group; ++c) {
    const int first = Dim0 + Group * c;
    f(Bytes<2 * kPerLane>(), first + kPerLane * lane, first / Lanes / 2);
  }
  if constexpr (D % Group != 0) {
    for_chunks<D % Group, Group / 2, Lanes, Dim0 + D / Group * Group>(lane, f);
  }
}

// Each QK chunk of lane t.
template <int D, bool Fp8, typename F>
__device__ __forceinline__ void for_qk_chunks(int t, F&& f) {
  for_chunks<D, Fp8 ? 64 : 32, 4>(t, f);
}

// Each PV chunk of lane g.
template <int D, bool Fp8, typename F>
__device__ __forceinline__ void for_pv_chunks(int g, F&& f) {
  for_chunks<D, Fp8 ? 128 : 64, 8>(g, f);
}

// Block ids of blocks base .. base + 31 of a sequence, one per lane (0 past
// the sequence's last block; clamped into the cache).
__device__ __forceinline__ int load_block_window(const Args& a,
                                                 const int32_t* table,
                                                 int base, int num_blocks_used,
                                                 int lane) {
  const int i = base + lane;
  return i < num_blocks_used ? clamp_block(table[i], a.num_blocks) : 0;
}

// Head sizes up to 128 load K and V of a step together (16 loads in flight a
// lane); larger ones load V after the scores, to stay within the registers.
template <int D>
constexpr bool kLoadKvTogether = D <= 128;

// A float8 cache's walk loads the next step's keys right after this step's
// score products, so they are in flight during its softmax and value
// products; the raw key bytes (widened at their products) take the registers
// the widened keys took.
template <int D, bool Fp8>
constexpr bool kPrefetchKeys = Fp8 && kLoadKvTogether<D>;

// Resident CTAs per multiprocessor the registers must allow: 4 x 4 warps
// (<= 128 registers a thread) up to head size 128; head size 256 holds twice
// the accumulators and rows, and gets half as many.
template <int D>
constexpr int kMmaMinCtas = D <= 128 ? 4 : 2;

// One warp's walk over keys [k_begin, k_end) (16 at a time) of one item:
// the online-softmax state it leaves behind. acc[i][0] / [2]: head 2t, the low
// / high dim of PV word i; [1] / [3]: head 2t + 1. m and l are per head
// (2t, 2t + 1); l is reduced over the warp, m is already warp-uniform.
//
// Fp8: the caches hold e4m3, and the products run in fp16 (q is fp16 too).
template <typename T, int D, bool Fp8>
__device__ __forceinline__ void mma_attend(const Args& a, const Item& it,
                                           const uint32_t* q, int k_begin,
                                           int k_end, float (&acc)[D / 16][4],
                                           float (&m)[2], float (&l)[2]) {
  using L = Layout<D>;
  using C = std::conditional_t<Fp8, uint8_t, T>;  // a cache element
  using M = std::conditional_t<Fp8, __half, T>;   // the products' type
  const int lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < L::kTiles; ++i) {
    acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  }
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  const int bs = a.block_size;
  const int32_t* table =
      a.block_tables + static_cast<int64_t>(it.seq) * a.block_tables_stride;
  const int blocks_used = static_cast<int>(ceil_div(it.kv_len, bs));
  int block_idx = k_begin / bs;  // block of the next step's first key
  int offset = k_begin - block_idx * bs;
  int window_base = block_idx;
  int window = k_begin < k_end ? load_block_window(a, table, window_base,
                                                   blocks_used, lane)
                               : 0;
  // The cache row of the next step's first key; moves on to the step after.
  auto next_step_row = [&]() {
    // The step's 16 keys lie in one block (block_size % 16 == 0).
    if (block_idx - window_base >= 32) {
      window_base = block_idx;
      window = load_block_window(a, table, window_base, blocks_used, lane);
    }
    const int block = __shfl_sync(0xffffffffu, window, block_idx - window_base);
    const int64_t row0 = static_cast<int64_t>(block) * bs + offset;
    offset += 16;
    if (offset == bs) {
      offset = 0;
      ++block_idx;
    }
    return row0;
  };

  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const C* key_cache =
      static_cast<const C*>(a.key_cache) + static_cast<int64_t>(it.kv_head) * D;
  const C* value_cache = static_cast<const C*>(a.value_cache) +
                         static_cast<int64_t>(it.kv_head) * D;
  // Row j of the step at key k whose first row is row0. Keys past the range
  // are masked; their rows are read from the last valid key so that every
  // load stays inside real data.
  auto row_ptr = [&](const C* cache, int64_t row0, int k, int j) {
    return cache + (row0 + min(j, k_end - 1 - k)) * kv_row;
  };
  // Raw rows of a step, as load_stream gives them: 16-bit pairs, or for a
  // float8 cache the bytes (widened at their products: fewer registers, and
  // for values fewer instructions once two keys' bytes are paired).
  constexpr int kKeyWords = Fp8 ? L::kQkWords / 2 : L::kQkWords;
  constexpr int kValueWords = Fp8 ? (L::kTiles + 1) / 2 : L::kTiles;
  // Key rows k + g and k + g + 8.
  auto load_keys = [&](uint32_t (&kw)[2][kKeyWords], int64_t row0, int k) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const C* p = row_ptr(key_cache, row0, k, g + 8 * r);
      for_qk_chunks<D, Fp8>(t, [&](auto bytes, int dim, int word) {
        constexpr int B = decltype(bytes)::value;
        load_stream<Fp8 ? B / 2 : B>(kw[r] + (Fp8 ? word / 2 : word), p + dim);
      });
    }
  };
  // Value rows k + 2t, +1, +8, +9.
  auto load_values = [&](uint32_t (&vw)[4][kValueWords], int64_t row0, int k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const C* p = row_ptr(value_cache, row0, k, 2 * t + (r & 1) + 8 * (r >> 1));
      for_pv_chunks<D, Fp8>(g, [&](auto bytes, int dim, int word) {
        constexpr int B = decltype(bytes)::value;
        load_stream<Fp8 ? B / 2 : B>(vw[r] + (Fp8 ? word / 2 : word), p + dim);
      });
    }
  };

  uint32_t kw[2][kKeyWords];
  int64_t row0 = 0;  // the first row of the step whose keys kw holds
  if (kPrefetchKeys<D, Fp8> && k_begin < k_end) {
    row0 = next_step_row();
    load_keys(kw, row0, k_begin);
  }
  for (int k = k_begin; k < k_end; k += 16) {
    if constexpr (!kPrefetchKeys<D, Fp8>) {
      row0 = next_step_row();
      load_keys(kw, row0, k);
    }
    const int64_t step_row0 = row0;
    uint32_t vw[4][kValueWords];
    if constexpr (kLoadKvTogether<D>) load_values(vw, step_row0, k);
    const int last = k_end - 1 - k;

    // S^T = K Q^T: s[0], s[1]: key k + g, heads 2t, 2t + 1; s[2], s[3]: key
    // k + g + 8.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < L::kTiles; ++i) {
      uint32_t k0lo, k0hi, k1lo, k1hi;  // words 2i, 2i + 1 of both rows
      if constexpr (Fp8) {  // raw word i holds the dims of both
        e4m3x4_to_f16x2x2(kw[0][i], k0lo, k0hi);
        e4m3x4_to_f16x2x2(kw[1][i], k1lo, k1hi);
      } else {
        k0lo = kw[0][2 * i];
        k0hi = kw[0][2 * i + 1];
        k1lo = kw[1][2 * i];
        k1hi = kw[1][2 * i + 1];
      }
      mma<M>(s, k0lo, k1lo, k0hi, k1hi, q[2 * i], q[2 * i + 1]);
    }
    if constexpr (kPrefetchKeys<D, Fp8>) {
      if (k + 16 < k_end) {
        row0 = next_step_row();
        load_keys(kw, row0, k + 16);
      }
    }
    const bool valid0 = g <= last, valid1 = g + 8 <= last;
    s[0] = valid0 ? s[0] * a.scale_log2 : -INFINITY;
    s[1] = valid0 ? s[1] * a.scale_log2 : -INFINITY;
    s[2] = valid1 ? s[2] * a.scale_log2 : -INFINITY;
    s[3] = valid1 ? s[3] * a.scale_log2 : -INFINITY;

    // Online softmax per head over the step's keys (lanes of equal t).
    float max0 = fmaxf(s[0], s[2]), max1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) {
      max0 = fmaxf(max0, __shfl_xor_sync(0xffffffffu, max0, mask));
      max1 = fmaxf(max1, __shfl_xor_sync(0xffffffffu, max1, mask));
    }
    max0 = fmaxf(m0, max0);
    max1 = fmaxf(m1, max1);
    const float c0 = exp2f(m0 - max0), c1 = exp2f(m1 - max1);  // 0 at first
    m0 = max0;
    m1 = max1;
    const float p0 = exp2f(s[0] - m0), p1 = exp2f(s[1] - m1);
    const float p2 = exp2f(s[2] - m0), p3 = exp2f(s[3] - m1);
    l0 = l0 * c0 + (p0 + p2);
    l1 = l1 * c1 + (p1 + p3);
    // c0 = c1 = 1 unless a running max moved, which after the first steps
    // is rare: skip the multiplications then.
    if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
      for (int i = 0; i < L::kTiles; ++i) {
        acc[i][0] *= c0;
        acc[i][1] *= c1;
        acc[i][2] *= c0;
        acc[i][3] *= c1;
      }
    }
    // P^T, the B operand of O^T = V^T P^T: (keys 2t, 2t+1 | 2t+8, 2t+9) x
    // head g, by transposing (key g | g+8) x heads (2t, 2t+1).
    const uint32_t pb0 = transpose8x8(pack2<M>(p0, p1));
    const uint32_t pb1 = transpose8x8(pack2<M>(p2, p3));

    if constexpr (!kLoadKvTogether<D>) load_values(vw, step_row0, k);
    // V^T tiles: row g / g + 8 = the low / high dim of word i, columns = keys.
#pragma unroll
    for (int i = 0; i < L::kTiles; ++i) {
      uint32_t a[4];
      if constexpr (Fp8) {
        // Raw word i / 2 holds the dims of words i - i % 2 (bytes 0, 1) and
        // i - i % 2 + 1 (bytes 2, 3): pair each dim's byte of two keys, then
        // widen the pairs.
        const uint32_t sel = i % 2 ? 0x7362 : 0x5140;
        e4m3x4_to_f16x2x2(__byte_perm(vw[0][i / 2], vw[1][i / 2], sel), a[0], a[1]);
        e4m3x4_to_f16x2x2(__byte_perm(vw[2][i / 2], vw[3][i / 2], sel), a[2], a[3]);
      } else {
        a[0] = __byte_perm(vw[0][i], vw[1][i], 0x5410);
        a[1] = __byte_perm(vw[0][i], vw[1][i], 0x7632);
        a[2] = __byte_perm(vw[2][i], vw[3][i], 0x5410);
        a[3] = __byte_perm(vw[2][i], vw[3][i], 0x7632);
      }
      mma<M>(acc[i], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  }

#pragma unroll
  for (int mask = 4; mask < 32; mask <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, mask);
    l1 += __shfl_xor_sync(0xffffffffu, l1, mask);
  }
  m[0] = m0;
  m[1] = m1;
  l[0] = l0;
  l[1] = l1;
}

// A CTA of kMmaWarps warps serves one item: each warp walks a contiguous
// share of the partition's 16-key steps, then the warps' results are merged
// through shared memory (so a decode batch needs no split across CTAs, and no
// merge kernel, to keep every multiprocessor busy).
template <typename T, int D, bool Fp8>
__global__ void __launch_bounds__(32 * kMmaWarps, kMmaMinCtas<D>)
    attention_mma_kernel(const Args a) {
  using L = Layout<D>;
  __shared__ float acc_s[kMmaWarps][kMaxHeadsPerCta][D];
  __shared__ float ml_s[kMmaWarps][kMaxHeadsPerCta][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  Item it;
  item_heads(a, blockIdx.x, it);

  // Q^T, the B operand of the scores: query head g of the CTA's heads (zero
  // columns past them). Loaded before the sequence lookup: it does not
  // depend on it.
  uint32_t q[L::kQkWords];
  {
    const bool has_head = g < it.num_heads;
    const T* qrow = static_cast<const T*>(a.query) +
                    it.token * a.query_stride +
                    static_cast<int64_t>(it.head0 + (has_head ? g : 0)) * D;
    for_qk_chunks<D, Fp8>(t, [&](auto bytes, int dim, int word) {
      constexpr int B = decltype(bytes)::value;
      load_words<B>(q + word, qrow + dim);
#pragma unroll
      for (int j = 0; j < B / 4; ++j) {
        if (!has_head) {
          q[word + j] = 0;
        } else if constexpr (Fp8 && !std::is_same_v<T, __half>) {
          const uint32_t w = q[word + j];  // bf16 pair -> fp16 pair
          q[word + j] = pack2<__half>(__uint_as_float(w << 16),
                                      __uint_as_float(w & 0xffff0000u));
        }
      }
    });
  }
  if (!item_keys(a, blockIdx.y, it)) return;

  // This warp's share: whole 16-key steps.
  const int steps = static_cast<int>(ceil_div(it.k_end - it.k_begin, 16));
  const int share = static_cast<int>(ceil_div(steps, kMmaWarps));
  const int k_begin = min(it.k_begin + 16 * share * warp, it.k_end);
  const int k_end = min(k_begin + 16 * share, it.k_end);
  float acc[L::kTiles][4], m[2], l[2];
  mma_attend<T, D, Fp8>(a, it, q, k_begin, k_end, acc, m, l);

  // Merge the warps: out = sum_w 2^(m_w - M) acc_w / sum_w 2^(m_w - M) l_w.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * t + h;
    if (head >= it.num_heads) continue;
    float* dst = acc_s[warp][head];
    for_pv_chunks<D, Fp8>(g, [&](auto bytes, int dim, int word) {
#pragma unroll
      for (int j = 0; j < decltype(bytes)::value / 4; ++j) {
        dst[dim + 2 * j] = acc[word + j][h];
        dst[dim + 2 * j + 1] = acc[word + j][h + 2];
      }
    });
    if (g == 0) {
      ml_s[warp][head][0] = m[h];
      ml_s[warp][head][1] = l[h];
    }
  }
  __syncthreads();
  const bool direct = it.num_parts == 1;
  T* out = static_cast<T*>(a.out) + it.token * a.out_stride +
           static_cast<int64_t>(it.head0) * D;
  for (int i = threadIdx.x; i < it.num_heads * D; i += 32 * kMmaWarps) {
    const int head = i / D, d = i - head * D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) mx = fmaxf(mx, ml_s[w][head][0]);
    float sum = 0.0f, val = 0.0f;
    if (mx != -INFINITY) {  // else: no keys at all (bad metadata): zeros
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        const float weight = exp2f(ml_s[w][head][0] - mx);
        sum += weight * ml_s[w][head][1];
        val += weight * acc_s[w][head][d];
      }
    }
    if (direct) {
      out[i] = from_float<T>(sum > 0.0f ? val / sum : 0.0f);
    } else {
      const int64_t idx =
          partial_index(a, it.token, it.head0 + head, blockIdx.y);
      a.partial_acc[idx * D + d] = val;
      if (d == 0) {
        a.partial_ml[2 * idx] = mx;
        a.partial_ml[2 * idx + 1] = sum;
      }
    }
  }
}

#endif  // !PAGODA_HIP

// ---------------------------------------------------------------------------
// SIMT kernel: any dtype, head size and block size; also the ROCm path.
//
// Per 32-key tile: the rows' offsets go to shared memory; thread (key j =
// tid % 32, heads tid / 32 + 4i) computes full dot products against the
// pre-scaled fp32 query rows in shared memory; one thread per head does the
// online-softmax update of the tile; then threads own head dims and add P V
// (value rows read coalesced, one dim per thread).
__host__ __device__ constexpr int64_t simt_smem_floats(int64_t heads,
                                                       int64_t head_size) {
  // q and acc [heads][head_size], p [heads][kSimtKeys], m, l, correction.
  return heads * (2 * head_size + kSimtKeys + 3);
}

template <typename T>
__global__ void __launch_bounds__(kSimtThreads)
    attention_simt_kernel(const Args a) {
  extern __shared__ float smem[];
  __shared__ int64_t row_s[kSimtKeys];  // element offset of each tile key
  Item it;
  item_heads(a, blockIdx.x, it);
  if (!item_keys(a, blockIdx.y, it)) return;

  const int tid = threadIdx.x;
  const int D = a.head_size, H = it.num_heads, hp = a.heads_per_cta;
  float* q_s = smem;
  float* acc_s = q_s + hp * D;
  float* p_s = acc_s + hp * D;
  float* m_s = p_s + hp * kSimtKeys;
  float* l_s = m_s + hp;
  float* c_s = l_s + hp;

  const T* q = static_cast<const T*>(a.query) + it.token * a.query_stride +
               static_cast<int64_t>(it.head0) * D;
  for (int i = tid; i < H * D; i += kSimtThreads) {
    q_s[i] = to_float(q[i]) * a.scale_log2;
    acc_s[i] = 0.0f;
  }
  if (tid < H) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }

  const int bs = a.block_size;
  const int32_t* table =
      a.block_tables + static_cast<int64_t>(it.seq) * a.block_tables_stride;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* key_cache =
      static_cast<const T*>(a.key_cache) + static_cast<int64_t>(it.kv_head) * D;
  const T* value_cache = static_cast<const T*>(a.value_cache) +
                         static_cast<int64_t>(it.kv_head) * D;

  for (int k = it.k_begin; k < it.k_end; k += kSimtKeys) {
    const int n = min(kSimtKeys, it.k_end - k);
    __syncthreads();  // the previous tile is done with row_s and p_s
    if (tid < n) {
      const int key = k + tid;
      const int b = key / bs;
      row_s[tid] =
          (static_cast<int64_t>(clamp_block(table[b], a.num_blocks)) * bs +
           (key - b * bs)) * kv_row;
    }
    __syncthreads();
    const int j = tid % kSimtKeys;
    if (j < n) {
      const T* krow = key_cache + row_s[j];
      for (int h = tid / kSimtKeys; h < H; h += kSimtThreads / kSimtKeys) {
        const float* qh = q_s + h * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qh[d] * to_float(krow[d]);
        p_s[h * kSimtKeys + j] = dot;
      }
    }
    __syncthreads();
    if (tid < H) {
      float* ps = p_s + tid * kSimtKeys;
      float mx = m_s[tid];
      for (int i = 0; i < n; ++i) mx = fmaxf(mx, ps[i]);
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) {
        const float p = exp2f(ps[i] - mx);
        ps[i] = p;
        sum += p;
      }
      const float c = exp2f(m_s[tid] - mx);  // 0 on the first tile
      c_s[tid] = c;
      l_s[tid] = l_s[tid] * c + sum;
      m_s[tid] = mx;
    }
    __syncthreads();
    for (int d = tid; d < D; d += kSimtThreads) {
      float o[kMaxHeadsPerCta];
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerCta; ++h) {
        o[h] = h < H ? acc_s[h * D + d] * c_s[h] : 0.0f;
      }
      for (int i = 0; i < n; ++i) {
        const float v = to_float(value_cache[row_s[i] + d]);
#pragma unroll
        for (int h = 0; h < kMaxHeadsPerCta; ++h) {
          if (h < H) o[h] += p_s[h * kSimtKeys + i] * v;
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxHeadsPerCta; ++h) {
        if (h < H) acc_s[h * D + d] = o[h];
      }
    }
  }
  __syncthreads();

  if (it.num_parts == 1) {
    T* orow = static_cast<T*>(a.out) + it.token * a.out_stride +
              static_cast<int64_t>(it.head0) * D;
    for (int i = tid; i < H * D; i += kSimtThreads) {
      const float l = l_s[i / D];
      orow[i] = from_float<T>(l > 0.0f ? acc_s[i] / l : 0.0f);
    }
  } else {
    for (int i = tid; i < H * D; i += kSimtThreads) {
      const int h = i / D, d = i - h * D;
      const int64_t idx =
          partial_index(a, it.token, it.head0 + h, blockIdx.y);
      a.partial_acc[idx * D + d] = acc_s[i];
      if (d == 0) {
        a.partial_ml[2 * idx] = m_s[h];
        a.partial_ml[2 * idx + 1] = l_s[h];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Merge of the partitions' partial results: one CTA per (token, query head).
// Threads split the head into V-float vectors and, when the head has fewer
// vectors than threads, the partitions into groups, summed at the end.

// Tree reduction over the CTA (blockDim.x a power of two); every thread gets
// the result.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* buf, Op op) {
  const int tid = threadIdx.x;
  buf[tid] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (tid < s) buf[tid] = op(buf[tid], buf[tid + s]);
    __syncthreads();
  }
  const float r = buf[0];
  __syncthreads();
  return r;
}

template <typename T, int V>
__global__ void __launch_bounds__(kReduceThreads)
    attention_merge_kernel(const Args a) {
  extern __shared__ float weight_s[];  // [num_partitions]
  __shared__ float red_s[kReduceThreads * V];
  const int token = blockIdx.x / a.num_heads;
  const int head = blockIdx.x - token * a.num_heads;
  const int seq = find_sequence(a.query_start_loc, a.num_seqs, token);
  const int num_parts = partitions_of(a, visible_keys(a, seq, token));
  if (num_parts <= 1) return;  // written by the attention kernel

  const int tid = threadIdx.x;
  const int64_t first = partial_index(a, token, head, 0);
  const float* ml = a.partial_ml + 2 * first;
  float mx = -INFINITY;
  for (int i = tid; i < num_parts; i += kReduceThreads) {
    mx = fmaxf(mx, ml[2 * i]);
  }
  mx = block_reduce(mx, red_s, [](float x, float y) { return fmaxf(x, y); });
  float sum = 0.0f;
  for (int i = tid; i < num_parts; i += kReduceThreads) {
    const float w = exp2f(ml[2 * i] - mx);
    weight_s[i] = w;
    sum += w * ml[2 * i + 1];
  }
  sum = block_reduce(sum, red_s, [](float x, float y) { return x + y; });
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;

  const int D = a.head_size;
  const int nvec = D / V;
  const int lanes = min(nvec, kReduceThreads);  // threads per partition group
  const int groups = kReduceThreads / lanes;
  const int grp = tid / lanes;
  const float* acc = a.partial_acc + first * D;
  T* orow = static_cast<T*>(a.out) + token * a.out_stride +
            static_cast<int64_t>(head) * D;
  float o[V];
  for (int vi = tid % lanes; vi < nvec && grp < groups; vi += lanes) {
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = 0.0f;
#pragma unroll 4
    for (int i = grp; i < num_parts; i += groups) {
      const float w = weight_s[i];
      const float* src = acc + static_cast<int64_t>(i) * D + vi * V;
      if constexpr (V == 4) {
        const float4 x = *reinterpret_cast<const float4*>(src);
        o[0] += w * x.x;
        o[1] += w * x.y;
        o[2] += w * x.z;
        o[3] += w * x.w;
      } else {
        o[0] += w * src[0];
      }
    }
    if (groups == 1) {
      Vec<T, V> out{};
#pragma unroll
      for (int j = 0; j < V; ++j) out.set(j, o[j] * inv);
      store_vec(orow + vi * V, out);
    }
  }
  if (groups > 1) {
    // One vector per thread (lanes == nvec): sum the groups.
    if (grp < groups) {
#pragma unroll
      for (int j = 0; j < V; ++j) red_s[grp * D + (tid % lanes) * V + j] = o[j];
    }
    __syncthreads();
    for (int vi = tid; vi < nvec; vi += kReduceThreads) {
      Vec<T, V> out{};
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float total = 0.0f;
        for (int gi = 0; gi < groups; ++gi) total += red_s[gi * D + vi * V + j];
        out.set(j, total * inv);
      }
      store_vec(orow + vi * V, out);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

bool mma_head_size(int64_t d) {
  return d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

bool use_mma(const PagedAttentionParams& p, int compute_capability_major) {
  if (PAGODA_HIP || compute_capability_major < 8) return false;
  if (p.dtype == DType::kFloat32 || !mma_head_size(p.head_size)) return false;
  if (p.block_size % 16 != 0) return false;
  // 16-byte loads and stores of every head row.
  return is_aligned(p.query, 16) && is_aligned(p.out, 16) &&
         is_aligned(p.key_cache, 16) && is_aligned(p.value_cache, 16) &&
         p.query_stride % 8 == 0 && p.out_stride % 8 == 0;
}

Args make_args(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
               float* workspace) {
  Args a;
  a.out = p.out;
  a.out_stride = p.out_stride;
  a.query = p.query;
  a.query_stride = p.query_stride;
  a.key_cache = p.key_cache;
  a.value_cache = p.value_cache;
  a.block_tables = p.block_tables;
  a.block_tables_stride = p.block_tables_stride;
  a.seq_lens = p.seq_lens;
  a.query_start_loc = p.query_start_loc;
  const int64_t partials = p.num_tokens * p.num_heads * plan.num_partitions;
  a.partial_acc = plan.num_partitions > 1 ? workspace : nullptr;
  a.partial_ml =
      plan.num_partitions > 1 ? workspace + partials * p.head_size : nullptr;
  a.scale_log2 = p.scale * kLog2e;
  a.num_seqs = static_cast<int>(p.num_seqs);
  a.num_heads = static_cast<int>(p.num_heads);
  a.num_kv_heads = static_cast<int>(p.num_kv_heads);
  a.head_size = static_cast<int>(p.head_size);
  a.block_size = static_cast<int>(p.block_size);
  a.num_blocks = static_cast<int>(p.num_blocks);
  const int64_t max_context = p.max_blocks_per_seq * p.block_size;
  a.max_context =
      static_cast<int>(max_context < INT_MAX ? max_context : INT_MAX);
  a.group = static_cast<int>(p.num_heads / p.num_kv_heads);
  a.heads_per_cta = plan.heads_per_cta;
  a.slices = static_cast<int>(ceil_div(a.group, plan.heads_per_cta));
  a.partition_size = static_cast<int>(plan.partition_size);
  a.num_partitions = static_cast<int>(plan.num_partitions);
  a.kv_fp8 = p.kv_fp8;
  return a;
}

template <typename T>
void launch_attention(const Args& a, const PagedAttentionPlan& plan,
                      int64_t num_tokens, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens * a.num_kv_heads * a.slices),
                  static_cast<unsigned>(plan.num_partitions));
#if !PAGODA_HIP
  if constexpr (!std::is_same_v<T, float>) {
    if (plan.kernel == kMmaKernel) {
      switch (a.head_size) {
#define PAGODA_CASE(D)                              \
  case D:                                           \
    if (a.kv_fp8) {                                 \
      attention_mma_kernel<T, D, true>              \
          <<<grid, 32 * kMmaWarps, 0, stream>>>(a); \
    } else {                                        \
      attention_mma_kernel<T, D, false>             \
          <<<grid, 32 * kMmaWarps, 0, stream>>>(a); \
    }                                               \
    return;
        PAGODA_CASE(64)
        PAGODA_CASE(80)
        PAGODA_CASE(96)
        PAGODA_CASE(128)
        PAGODA_CASE(256)
#undef PAGODA_CASE
        default:
          break;
      }
    }
  }
#endif
  const size_t smem =
      simt_smem_floats(a.heads_per_cta, a.head_size) * sizeof(float);
  attention_simt_kernel<T><<<grid, kSimtThreads, smem, stream>>>(a);
}

template <typename T>
void launch_merge(const Args& a, const PagedAttentionParams& p,
                  int64_t num_tokens, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(num_tokens * a.num_heads);
  const size_t smem = static_cast<size_t>(a.num_partitions) * sizeof(float);
  // 4-float vectors of the partial rows, 4-element stores of out.
  const bool vec4 = p.head_size % 4 == 0 && is_aligned(p.out, 4 * sizeof(T)) &&
                    p.out_stride % 4 == 0;
  if (vec4) {
    attention_merge_kernel<T, 4><<<grid, kReduceThreads, smem, stream>>>(a);
  } else {
    attention_merge_kernel<T, 1><<<grid, kReduceThreads, smem, stream>>>(a);
  }
}

template <typename T>
cudaError_t run(const PagedAttentionParams& p, const PagedAttentionPlan& plan,
                float* workspace, cudaStream_t stream) {
  const Args a = make_args(p, plan, workspace);
  launch_attention<T>(a, plan, p.num_tokens, stream);
  if (plan.num_partitions > 1) launch_merge<T>(a, p, p.num_tokens, stream);
  return cudaGetLastError();
}

}  // namespace

PagedAttentionPlan plan_paged_attention(const PagedAttentionParams& p,
                                        int multiprocessor_count,
                                        int compute_capability_major) {
  PagedAttentionPlan plan{kSimtKernel, 1, 1, kPartitionAlign, 0, nullptr};
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0 || p.head_size <= 0 ||
      p.block_size <= 0) {
    return plan;
  }
  const int64_t group = p.num_heads / p.num_kv_heads;
  const bool mma = use_mma(p, compute_capability_major);
  if (p.kv_fp8 && !mma) {
    plan.error =
        "a float8 KV cache needs the tensor-core kernel: bf16/fp16, head size "
        "64/80/96/128/256, a block size that is a multiple of 16, 16-byte "
        "aligned rows";
    return plan;
  }
  int64_t cap = kMaxHeadsPerCta;
  if (!mma) {
    const int64_t fit =
        kSimtSmemBytes /
        static_cast<int64_t>(sizeof(float) * simt_smem_floats(1, p.head_size));
    cap = fit < cap ? fit : cap;
    if (cap < 1) {
      plan.error = "head_size is too large for the GPU paged_attention kernels";
      return plan;
    }
  }
  const int64_t slices = ceil_div(group, cap);
  plan.kernel = mma ? kMmaKernel : kSimtKernel;
  plan.heads_per_cta = static_cast<int32_t>(ceil_div(group, slices));
  const int64_t units = p.num_tokens * p.num_kv_heads * slices;
  if (units > INT_MAX || p.num_tokens * p.num_heads > INT_MAX) {
    plan.error = "too many query tokens x heads for one paged_attention launch";
    return plan;
  }
  int64_t max_context = p.max_blocks_per_seq * p.block_size;
  if (max_context > INT_MAX) max_context = INT_MAX;

  // Split each token's keys into partitions until the grid has about
  // `target` CTAs (decided by shapes alone: a graph replays it as is).
  const int64_t sms = multiprocessor_count > 0 ? multiprocessor_count : 1;
  const int64_t target = sms * (mma ? kMmaCtasPerSm : kSimtCtasPerSm);
  int64_t parts = ceil_div(max_context, kMinPartition);
  const int64_t wanted = target / units;
  if (parts > wanted) parts = wanted;
  if (parts > kMaxPartitions) parts = kMaxPartitions;
  if (parts < 1) parts = 1;
  int64_t size = ceil_div(ceil_div(max_context, parts), kPartitionAlign) *
                 kPartitionAlign;
  if (size < kPartitionAlign) size = kPartitionAlign;
  plan.partition_size = size;
  plan.num_partitions = max_context > 0 ? ceil_div(max_context, size) : 1;
  plan.workspace_floats =
      plan.num_partitions > 1
          ? p.num_tokens * p.num_heads * plan.num_partitions * (p.head_size + 2)
          : 0;
  return plan;
}

cudaError_t paged_attention(const PagedAttentionParams& p,
                            const PagedAttentionPlan& plan, float* workspace,
                            cudaStream_t stream) {
  if (plan.error != nullptr) return cudaErrorInvalidValue;
  if (p.num_tokens <= 0 || p.num_seqs <= 0 || p.num_heads <= 0 ||
      p.num_kv_heads <= 0 || p.head_size <= 0 || p.block_size <= 0) {
    return cudaSuccess;
  }
  if (p.max_blocks_per_seq <= 0 || p.num_blocks <= 0 ||
      (plan.num_partitions > 1 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  switch (p.dtype) {
    case DType::kFloat32:
      return run<float>(p, plan, workspace, stream);
    case DType::kBFloat16:
      return run<uint16_t>(p, plan, workspace, stream);
    case DType::kFloat16:
      return run<__half>(p, plan, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace pagoda
