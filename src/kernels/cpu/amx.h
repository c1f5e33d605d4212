// The AMX micro-kernels: the flash kernel's two tile products on bf16 operands with Intel AMX
// tiles (`tdpbf16ps`: a 16 x 16 f32 tile += a 16 x 32 bf16 tile times a 32 x 16 bf16 tile,
// pairs along the reduction axis accumulated in f32). GCC 12 emits the instructions from raw
// intrinsics with -mamx-tile -mamx-bf16, so they live in one ISA-specific file (amx_tiles.cc),
// reached only when available() (CPUID, XCR0 and the Linux tile-data permission). The Highway
// side (AmxProducts in products-inl.h) lays the operands out as the tiles read them.
// docs/kernels.md, "AMX tiles".
//
// Layouts, for one query block of kLanes queries (scores transposed, as everywhere: st[key][query]):
//   q pairs   qp[t][l] = (q[l][2t], q[l][2t + 1])        [depth / 2][kLanes] uint32
//   K rows    k[j][d] bf16, row stride k_stride elements [round_up(num_k, 16)][depth]
//   V columns vt[e][j] bf16 (keys along a row)           [round_up(dv, 16)][vt_stride]
//   probs     pp[t][l] = (p[2t][l], p[2t + 1][l]) bf16   [round_up(num_k, 32) / 2][kLanes]
//   st        [round_up(num_k, 16)][kLanes] f32          ot [round_up(dv, 16)][kLanes] f32
// depth is a multiple of kDepthStep; operands are zero past their real extent (head_dim, num_k,
// dv) up to the padded one, so padding adds exact zeros. bf16 subnormal inputs count as zero.
#pragma once

#include <cstdint>

namespace qkv::amx {

constexpr std::int64_t kLanes = 64;      // query lanes of a block (the AVX3 targets' kBlockQ)
constexpr std::int64_t kTileRows = 16;   // rows of a tile: keys (scores) or value dims (values)
constexpr std::int64_t kDepthStep = 32;  // bf16 along the reduction axis per tile product

constexpr std::int64_t round_up(std::int64_t n, std::int64_t step) {
  return (n + step - 1) / step * step;
}

// True when this CPU and OS run AMX-BF16 tiles and AVX512-BF16 (CPUID; XCR0 enables the tile
// state; on Linux the process was granted XTILEDATA, requested once here) and set_enabled(false)
// has not switched them off. Cheap after the first call.
bool available();

// Tests take the other paths: set_enabled(false) makes available() false until
// set_enabled(true). Not meant to be flipped while kernels run on other threads.
void set_enabled(bool enabled);

// The functions below run AMX instructions: call them only when available(), on a thread inside
// a TileScope.

// Loads the tile configuration every function here uses on the calling thread (8 tiles of
// 16 rows x 64 bytes) and releases the tile state at scope end, so a thread that runs other AMX
// code (oneDNN) between tasks finds its own configuration again.
class TileScope {
 public:
  TileScope();
  ~TileScope();
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// st[j][l] = scale * sum_{d < depth} k[j][d] * q[l][d] for j < round_up(num_k, 16), l < lanes
// (scale 1: no pass over st after the tile stores); st's lanes past `lanes` are left as they are.
// lanes: a multiple of 32 (a block product's lanes) up to kLanes: a block of at most 32 rows
// computes half (AmxProducts in products-inl.h).
// k: 64-byte rows at any alignment (k_stride * 2 bytes apart); qp and st 64-byte aligned.
void scores(const std::uint16_t* k, std::int64_t k_stride, const std::uint32_t* qp,
            std::int64_t depth, std::int64_t num_k, float scale, float* st,
            std::int64_t lanes = kLanes);

// pp[t][l] = (bf16(p[2t][l]), bf16(p[2t + 1][l])) for t < round_up(num_k, 32) / 2, rounded to
// nearest even, with p[j][l] = st[j][l] for keys j < end(l) and +0 past it, where end(l) =
// key_end[l / 16] (key_end nullable: num_k; each <= num_k). The probabilities are finite and
// >= 0 below end(l); what lies past it is never read. st and pp are 64-byte aligned.
// Only the query vectors x (16 lanes each) whose bit x is set in `vecs`; the others' pp words
// are left as they are.
void pack_probs(const float* st, std::int64_t num_k, const std::int64_t* key_end,
                std::uint32_t* pp, unsigned vecs = 0xF);

// The online softmax step of the lazy max (online_softmax-inl.h, OnlineSoftmaxTile<true>) fused
// with pack_probs, for the tiles where the running max stays: per query vector x whose running
// max m2 (row_max, base 2) is finite in every lane, one pass over st's keys [0, end(x)) takes
// their max (ColumnMax's four chains) and p = 2^(s * c - m2) (fastexp::Pow2CoarseHalf of
// s * c - (m2 - 1/2), bit for bit)
// and writes pp as pack_probs does. If the tile's max * c stays within `slack` above m2 in every
// lane, the vector is done as OnlineSoftmaxTile would have done it: row_sum += the p's (in key
// order), alpha = 1, row_max unchanged. Else (or when m2 is not finite) its bit is set in the
// result and nothing of it is written but pp: the caller runs the two passes on it. st is only
// read; row_max, row_sum, alpha 64-byte aligned. Only the query vectors x whose bit x is set in
// `vecs` (as pack_probs); the others are neither touched nor flagged.
unsigned softmax_pack_lazy(const float* st, std::int64_t num_k, const std::int64_t* key_end,
                           float c, float slack, const float* row_max, float* row_sum, float* alpha,
                           std::uint32_t* pp, unsigned vecs = 0xF);

// The second pass of the online softmax step where the running max moves (a block's first tile;
// the vectors softmax_pack_lazy leaves to the caller, who took the tile's max): for query
// vector x, p = 2^(s * c - shift) (fastexp::Pow2CoarseHalf of s * c - (shift - 1/2), the bits of
// ExpInPlaceAndSum<true>) for st's keys [0, end(x)), written as pack_probs writes them (+0 past
// end(x)); sum[l] = the lane's p's added in key order. shift: 16 floats (the new running max,
// base 2, or 0 where it is -inf); st is only read; shift, sum and pp 64-byte aligned.
void exp_pack(const float* st, std::int64_t num_k, const std::int64_t* key_end, int x, float c,
              const float* shift, float* sum, std::uint32_t* pp);

// ot[e][l] = alpha[l] * ot[e][l] + sum_{j < num_k} vt[e][j] * p[j][l] for e < round_up(dv, 16),
// l < lanes (alpha null: no rescale; where alpha is 0 for 32 lanes, their ot is not read: it
// must be finite), p from pack_probs (the same num_k and key_end). lanes as for scores: ot's
// lanes past it (and alpha's, pp's) are neither read nor written. vt: rows
// vt_stride elements apart (a multiple of 32), zero past num_k up to round_up(num_k, 32). ot,
// vt and pp are 64-byte aligned.
void values(const std::uint16_t* vt, std::int64_t vt_stride, const std::uint32_t* pp,
            std::int64_t num_k, std::int64_t dv, const float* alpha, const std::int64_t* key_end,
            float* ot, std::int64_t lanes = kLanes);

// Peak probe: `iterations` rounds of 4 independent tdpbf16ps (16 x 16 x 32) on the calling
// thread (which it configures and releases itself); returns a checksum of the accumulators.
// FLOPs = iterations * 4 * 16 * 16 * 32 * 2.
double peak_probe(std::int64_t iterations);

// Overlap probe: whether the tile unit runs while the vector units do the softmax, the question
// that bounds the flash kernel on AMX (docs/kernels.md, "The ceiling"). Each of `iterations`
// rounds issues kOverlapTileProducts independent tdpbf16ps on tiles that stay in the registers
// (kTiles), the fused softmax's own code (softmax_pack_lazy's exp, sum, max and packing) over
// kOverlapKeys keys of one query vector of an L1-resident score tile (kSoftmax), or both,
// independent of each other (kBoth). Timed apart and together (tools::measure_amx_overlap):
// together = the sum of the two alone means they take turns; = the longer alone means one hides
// the other. Configures and releases the tiles itself; returns a checksum.
enum class OverlapPart { kTiles, kSoftmax, kBoth };
constexpr int kOverlapTileProducts = 16;
constexpr std::int64_t kOverlapKeys = 32;
double overlap_probe(std::int64_t iterations, OverlapPart part);

}  // namespace qkv::amx
