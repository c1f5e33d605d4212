// Sentence embeddings with a sentence-transformers folder (all-MiniLM-L6-v2: scripts/fetch_model.sh
// fetches it), and their cosine similarities.
//
//   embed_sentences MODEL_DIR
//
// Prints the embedding size, each sentence's first values and the similarity matrix; exits 1
// if the model cannot be loaded, or if the paraphrase pair is not the most similar one.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "qkv/error.h"
#include "qkv/models/sentence_embedder.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: embed_sentences MODEL_DIR\n");
    return 2;
  }
  const std::vector<std::string> texts = {
      "A man is playing a guitar.",
      "Someone plays the guitar.",
      "The stock market fell sharply today.",
  };
  try {
    const auto embedder = qkv::models::SentenceEmbedder::load(argv[1]);
    const std::int64_t dim = embedder.dimension();
    std::vector<float> embeddings(texts.size() * dim);  // [N, dim], L2-normalised
    embedder.embed(texts, embeddings.data());

    std::printf("embed_sentences: %zu texts, dimension %lld, normalised %s\n", texts.size(),
                (long long)dim, embedder.normalize() ? "yes" : "no");
    std::vector<std::vector<double>> cosine(texts.size(), std::vector<double>(texts.size()));
    for (std::size_t a = 0; a < texts.size(); ++a) {
      for (std::size_t b = 0; b < texts.size(); ++b) {
        double dot = 0, norm_a = 0, norm_b = 0;
        for (std::int64_t d = 0; d < dim; ++d) {
          const double x = embeddings[a * dim + d], y = embeddings[b * dim + d];
          dot += x * y, norm_a += x * x, norm_b += y * y;
        }
        cosine[a][b] = dot / std::sqrt(norm_a * norm_b);
      }
      std::printf("  [%zu] %-40s [%.4f %.4f %.4f ...]  cos: %.4f %.4f %.4f\n", a, texts[a].c_str(),
                  embeddings[a * dim], embeddings[a * dim + 1], embeddings[a * dim + 2],
                  cosine[a][0], cosine[a][1], cosine[a][2]);
    }
    return cosine[0][1] > cosine[0][2] && cosine[0][1] > cosine[1][2] ? 0 : 1;
  } catch (const qkv::Error& error) {
    std::fprintf(stderr, "embed_sentences: %s\n", error.what());
    return 1;
  }
}
