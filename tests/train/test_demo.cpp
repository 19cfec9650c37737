// The demo config (configs/demo-moe.yaml) on the real fortunes corpus with its
// SentencePiece tokenizer: 20 iterations, and the loss falls.
#include <gtest/gtest.h>

#include <filesystem>

#include "data/preprocess.h"
#include "data/tokenizer.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

const char* kCorpus = "/usr/share/games/fortunes";

TEST(Demo, MoEConfigLossFallsIn20Iterations) {
  if (!fs::is_directory(kCorpus)) GTEST_SKIP() << kCorpus << " missing (Debian package fortunes)";
  fs::path dir = fs::temp_directory_path() / ("megaton_demo_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);

  data::SentencePieceTrainOptions sp;
  sp.input_format = data::InputFormat::Fortune;
  data::train_sentencepiece({kCorpus}, 8000, (dir / "sp").string(), sp);
  data::PreprocessOptions pre;
  pre.inputs = {kCorpus};
  pre.input_format = data::InputFormat::Fortune;
  pre.output_prefix = (dir / "fortunes").string();
  pre.tokenizer_type = "SentencePieceTokenizer";
  pre.tokenizer_model = (dir / "sp.model").string();
  pre.workers = 2;
  data::preprocess(pre);

  RawOptions raw = read_yaml_options(std::string(MEGATON_SOURCE_DIR) + "/configs/demo-moe.yaml");
  raw["tokenizer-model"] = {(dir / "sp.model").string()};
  raw["data-path"] = {(dir / "fortunes_text_document").string()};
  raw["train-iters"] = {"20"};
  raw["lr-warmup-iters"] = {"5"};  // the demo's 50 warmup iterations do not fit in 20
  raw["eval-iters"] = {"1"};
  raw["log-interval"] = {"5"};
  raw.erase("save-interval");
  TrainArgs args = parse_train_args(raw);
  TrainResult r = Trainer(args, raw).train();
  ASSERT_EQ(r.losses.size(), 20u);
  double first = (r.losses[0] + r.losses[1]) / 2, last = (r.losses[18] + r.losses[19]) / 2;
  EXPECT_LT(last, first - 1.0) << "loss did not fall: " << first << " -> " << last;
  EXPECT_LT(r.last_valid_loss, r.first_valid_loss - 1.0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace megaton
