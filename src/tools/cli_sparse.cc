#include "tools/cli_sparse.h"

#include <limits>

#include "core/int_math.h"
#include "qkv/error.h"

namespace qkv::cli {

const char* const kSparseHelp =
    R"(sparsity (block-sparse exact attention, ANDed with every mask above; docs/sparse.md):
  --sparse longformer:w=W[,dilation=D][,global=P1,P2,...]
                       sliding window |i' - j| <= W (with dilation D: only (i' - j) % D == 0)
                       plus global positions that attend every key and that every query attends
  --sparse bigbird[:block=B][,random=R][,global=G][,seed=S]
                       BigBird ITC: blocks of B (default 64), 3-block window, the first G blocks
                       global (default 2), R random key blocks per query block (default 3) drawn
                       from seed S (default 0)
  --sparse-layout L.npy  bool/uint8 block matrix (nqb, nkb) or (Hq, nqb, nkb), true = attend;
                       nqb = ceil(Lq / BQ), nkb = ceil(Lk / BK); needs --sparse-block
  --sparse-block BQ,BK query and key block sizes of --sparse-layout
)";

namespace {

// "w=256,dilation=2,global=0,5,9" -> {("w", {256}), ("dilation", {2}), ("global", {0, 5, 9})}:
// an item without '=' continues the list of the key before it.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> parse_items(
    const std::string& text) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> items;
  std::size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    const std::size_t eq = item.find('=');
    if (eq != std::string::npos) {
      const std::string key = item.substr(0, eq);
      for (const auto& [seen, values] : items) {
        if (seen == key) throw UsageError("--sparse: key '" + key + "' given more than once");
      }
      items.push_back({key, {parse_int("--sparse " + key, item.substr(eq + 1))}});
    } else {
      if (items.empty()) {
        throw UsageError("--sparse: expected key=value, got '" + item + "' in '" + text + "'");
      }
      items.back().second.push_back(parse_int("--sparse " + items.back().first, item));
    }
    start = comma + 1;
  }
  return items;
}

// The single value of a key; a list is only allowed for global= of longformer.
std::int64_t single(const std::pair<std::string, std::vector<std::int64_t>>& item,
                    std::int64_t min) {
  if (item.second.size() != 1) {
    throw UsageError("--sparse: " + item.first + " takes one integer, got " +
                     std::to_string(item.second.size()));
  }
  const std::int64_t value = item.second[0];
  if (value < min) {
    throw UsageError("--sparse: " + item.first + " must be >= " + std::to_string(min) + ", got " +
                     std::to_string(value));
  }
  return value;
}

void parse_spec(SparseCliOptions& o) {
  const std::string& text = o.spec;
  const std::size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string rest = colon == std::string::npos ? "" : text.substr(colon + 1);
  if (kind == "longformer") {
    LongformerSparsity s;
    bool has_window = false;
    for (const auto& item : parse_items(rest)) {
      if (item.first == "w") {
        s.window = single(item, 0);
        has_window = true;
      } else if (item.first == "dilation") {
        s.dilation = single(item, 1);
      } else if (item.first == "global") {
        for (std::int64_t g : item.second) {
          if (g < 0) throw UsageError("--sparse: global position " + std::to_string(g) + " < 0");
        }
        o.global = item.second;
      } else {
        throw UsageError("--sparse: unknown key '" + item.first +
                         "' for longformer (expected w, dilation, global)");
      }
    }
    if (!has_window) {
      throw UsageError("--sparse: longformer needs w=W (one-sided window), got '" + text + "'");
    }
    s.global = o.global;
    o.parsed = s;
  } else if (kind == "bigbird") {
    BigBirdSparsity s;
    for (const auto& item : parse_items(rest)) {
      if (item.first == "block") {
        s.block = single(item, 1);
      } else if (item.first == "random") {
        s.num_random_blocks = single(item, 0);
      } else if (item.first == "global") {
        s.num_global_blocks = single(item, 0);
      } else if (item.first == "seed") {
        s.seed = static_cast<std::uint64_t>(single(item, 0));
      } else {
        throw UsageError("--sparse: unknown key '" + item.first +
                         "' for bigbird (expected block, random, global, seed)");
      }
    }
    o.parsed = s;
  } else {
    throw UsageError("--sparse: expected longformer:w=W[,...] or bigbird[:...], got '" + text +
                     "'");
  }
}

}  // namespace

bool parse_sparse_option(const std::string& name, Args& args, SparseCliOptions& o) {
  if (name == "--sparse") {
    o.spec = args.value(name);
    parse_spec(o);
  } else if (name == "--sparse-layout") {
    o.layout_path = args.value(name);
    if (o.layout_path.empty() || o.layout_path.rfind("--", 0) == 0) {
      throw UsageError("--sparse-layout: missing file name (got '" + o.layout_path + "')");
    }
  } else if (name == "--sparse-block") {
    o.block_text = args.value(name);
    const std::vector<std::int64_t> sizes = parse_int_list(name, o.block_text);
    if (sizes.size() != 2 || sizes[0] < 1 || sizes[1] < 1) {
      throw UsageError("--sparse-block: expected BQ,BK (two integers >= 1), got '" + o.block_text +
                       "'");
    }
    o.block_q = sizes[0];
    o.block_k = sizes[1];
  } else {
    return false;
  }
  return true;
}

void check_sparse_options(const SparseCliOptions& o) {
  if (!o.spec.empty() && !o.layout_path.empty()) {
    throw UsageError("--sparse-layout: cannot be combined with --sparse " + o.spec);
  }
  if (!o.layout_path.empty() && o.block_text.empty()) {
    throw UsageError("--sparse-layout: needs --sparse-block BQ,BK (the block sizes)");
  }
  if (o.layout_path.empty() && !o.block_text.empty()) {
    throw UsageError("--sparse-block: only applies to --sparse-layout L.npy");
  }
}

std::optional<Sparsity> make_sparsity(SparseCliOptions& o, io::NpyArray& layout, std::int64_t seq_q,
                                      std::int64_t seq_kv, std::int64_t num_heads_q,
                                      const std::string& sources) {
  if (auto* longformer = o.parsed ? std::get_if<LongformerSparsity>(&*o.parsed) : nullptr) {
    longformer->global = o.global;  // re-pointed: `o` may have been moved since parsing
  }
  if (o.parsed) return o.parsed;
  if (o.layout_path.empty()) return std::nullopt;
  const std::string where = "--sparse-layout " + o.layout_path;
  layout = io::read_npy(o.layout_path, "--sparse-layout");
  if (layout.dtype != DType::kBool && layout.dtype != DType::kU8) {
    throw Error(where + ": dtype " + io::npy_type_name(layout.dtype) +
                " is not supported; expected bool or uint8");
  }
  const std::int64_t nqb = ceil_div(seq_q, o.block_q);
  const std::int64_t nkb = ceil_div(seq_kv, o.block_k);
  const std::vector<std::int64_t>& shape = layout.shape;
  const bool ok = (shape.size() == 2 && shape[0] == nqb && shape[1] == nkb) ||
                  (shape.size() == 3 && (shape[0] == num_heads_q || shape[0] == 1) &&
                   shape[1] == nqb && shape[2] == nkb);
  if (!ok) {
    throw Error(where + ": shape " + io::npy_shape_string(shape) +
                " does not match (ceil(Lq / BQ), ceil(Lk / BK)) = (" + std::to_string(nqb) + ", " +
                std::to_string(nkb) + ") or (Hq = " + std::to_string(num_heads_q) + ", " +
                std::to_string(nqb) + ", " + std::to_string(nkb) + ") for --sparse-block " +
                o.block_text + " (Lq = " + std::to_string(seq_q) +
                ", Lk = " + std::to_string(seq_kv) + " " + sources + ")");
  }
  const std::int64_t heads = shape.size() == 3 ? shape[0] : 1;
  return BlockSparsity{
      .layout = TensorView::contiguous(layout.data(), layout.dtype, {1, heads, nqb, nkb}),
      .block_q = o.block_q,
      .block_k = o.block_k};
}

std::string sparse_option_text(const SparseCliOptions& o) {
  return o.layout_path.empty() ? "--sparse " + o.spec : "--sparse-layout " + o.layout_path;
}

}  // namespace qkv::cli
