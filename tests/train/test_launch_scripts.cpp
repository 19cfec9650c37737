// Megatron launch scripts run in Megaton (issue 19): launch lines in the style of
// Megatron-LM's examples (gpt3/train_gpt3_175b_distributed.sh,
// llama/train_llama3_8b_h100_fp8.sh, mixtral/train_mixtral_8x7b_distributed.sh,
// megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh), written here with sizes scaled down to the
// CPU. Every flag must be known to Megaton; the flags refused (features Megaton does not
// have, mostly of open issues) are exactly those listed per line, so a flag that becomes
// refused, or a refused one that becomes implemented, fails the test by name. Without them,
// each line trains on the CPU through the megaton binary.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "data/preprocess.h"
#include "train/arguments.h"
#include "train_testing.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

const std::string kGolden = std::string(MEGATON_SOURCE_DIR) + "/tests/golden/tokenizers/";

// Shell words of `line` (spaces separate; double quotes group).
std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false, any = false;
  for (char c : line) {
    if (c == '"') {
      quoted = !quoted;
      any = true;
    } else if (c == ' ' && !quoted) {
      if (any) out.push_back(cur);
      cur.clear();
      any = false;
    } else {
      cur += c;
      any = true;
    }
  }
  if (any) out.push_back(cur);
  return out;
}

struct LaunchLine {
  const char* name;
  std::string args;
  std::set<std::string> refused;  // features of open issues, with the issue in the reason
};

class LaunchScripts : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("megaton_launch_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    // A small corpus tokenized with GPT-2's files (the GPT-3 script's data).
    testing::write_grammar_corpus(dir / "corpus.jsonl", 200, 7);
    data::PreprocessOptions o;
    o.inputs = {(dir / "corpus.jsonl").string()};
    o.output_prefix = (dir / "gpt2").string();
    o.tokenizer_type = "GPT2BPETokenizer";
    o.vocab_file = kGolden + "gpt2/vocab.json";
    o.merge_file = kGolden + "gpt2/merges.txt";
    data::preprocess(o);
  }
  void TearDown() override { fs::remove_all(dir); }

  // Checks the rules of every flag of `line`, then runs it without the refused flags.
  void check(const LaunchLine& line) {
    SCOPED_TRACE(line.name);
    std::vector<std::string> argv = words(line.args);
    std::set<std::string> refused;
    std::vector<std::string> kept;
    for (size_t i = 0; i < argv.size(); ++i) {
      if (!argv[i].starts_with("--")) {
        kept.push_back(argv[i]);
        continue;
      }
      const std::string name = argv[i].substr(2);
      const OptionSpec* spec = find_option_spec(name);
      ASSERT_NE(spec, nullptr) << "--" << name << " is unknown to Megaton";
      if (spec->rule != FlagRule::Unsupported) {
        kept.push_back(argv[i]);
        continue;
      }
      refused.insert(name);
      while (i + 1 < argv.size() && !argv[i + 1].starts_with("--")) ++i;  // and its values
    }
    EXPECT_EQ(refused, line.refused) << "flags refused";
    std::string cmd = std::string(MEGATON_BINARY) + " train";
    for (const std::string& w : kept) cmd += " '" + w + "'";
    const std::string out = (dir / (std::string(line.name) + ".txt")).string();
    const int rc = std::system((cmd + " > " + out + " 2>&1").c_str());
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(rc, 0) << cmd << "\n" << text.substr(text.size() > 3000 ? text.size() - 3000 : 0);
    EXPECT_NE(text.find(" iteration        2/"), std::string::npos) << text;
  }

  std::string path(const std::string& name) const { return (dir / name).string(); }
  fs::path dir;
};

TEST_F(LaunchScripts, Gpt3) {
  check({"gpt3",
         "--device cpu --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --attention-backend auto --micro-batch-size 1 "
         "--step-batch-size-schedule \"0:2 128:4\" --train-iters 4 --weight-decay 0.1 "
         "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 "
         "--lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
         "--lr-decay-iters 3 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
         "--data-path " + path("gpt2_text_document") + " --tokenizer-type GPT2BPETokenizer "
         "--vocab-file " + kGolden + "gpt2/vocab.json --merge-file " + kGolden +
             "gpt2/merges.txt --split 949,50,1 --log-interval 1 --save-interval 2 "
             "--eval-interval 2 --save " + path("gpt3_ckpt") + " --load " + path("gpt3_ckpt") +
             " --eval-iters 1 --tensorboard-dir " + path("gpt3_tb"),
         {}});
}

TEST_F(LaunchScripts, Llama3) {
  check({"llama3",
         "--device cpu --use-mcore-models --num-layers 2 --hidden-size 32 --ffn-hidden-size 64 "
         "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 8 "
         "--position-embedding-type rope --rotary-base 500000 --rotary-percent 1.0 "
         "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 "
         "--attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights "
         "--disable-bias-linear --normalization RMSNorm --micro-batch-size 1 "
         "--global-batch-size 2 --train-samples 8 --lr-decay-samples 8 --lr-warmup-samples 2 "
         "--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
         "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
         "--adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion "
         "--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
         "--exit-duration-in-mins 235 --tensor-model-parallel-size 1 --context-parallel-size 1 "
         "--pipeline-model-parallel-size 1 --sequence-parallel --use-distributed-optimizer "
         "--overlap-grad-reduce --overlap-param-gather --mock-data --tokenizer-type "
         "HuggingFaceTokenizer --tokenizer-model " + kGolden + "llama3 --seq-length 32 "
         "--max-position-embeddings 32 --data-cache-path " + path("llama_cache") +
             " --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
             "--num-workers 1 --log-interval 1 --eval-iters 1 --eval-interval 2 "
             "--save-interval 2 --log-throughput --profile --profile-step-start 4 "
             "--profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
             "--save " + path("llama_ckpt") + " --load " + path("llama_ckpt") +
             " --tensorboard-dir " + path("llama_tb"),
         // Refused without an open issue: zero-centered LayerNorm gammas and a separate
         // learning rate for the embedding and output layers.
         {"apply-layernorm-1p", "decoupled-lr", "decoupled-min-lr"}});
}

TEST_F(LaunchScripts, Mixtral) {
  check({"mixtral",
         "--device cpu --use-mcore-models --disable-bias-linear --seq-length 32 "
         "--max-position-embeddings 32 --num-layers 2 --hidden-size 32 --ffn-hidden-size 64 "
         "--num-attention-heads 4 --init-method-std 0.01 --attention-dropout 0.0 "
         "--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope "
         "--swiglu --untie-embeddings-and-output-weights --group-query-attention "
         "--num-query-groups 2 --no-masked-softmax-fusion --no-position-embedding "
         "--rotary-base 1000000 --num-experts 4 --moe-router-topk 2 "
         "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
         "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-grad-reduce "
         "--overlap-param-gather --micro-batch-size 1 --global-batch-size 2 --lr 1e-4 "
         "--train-iters 3 --lr-decay-iters 3 --lr-decay-style cosine --min-lr 1.0e-5 "
         "--weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 --bf16 "
         "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
         "--expert-model-parallel-size 1 --use-distributed-optimizer --sequence-parallel "
         "--mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model " + kGolden +
             "qwen2 --split 99990,8,2 --log-interval 1 --save-interval 2 --eval-interval 2 "
             "--eval-iters 1 --save " + path("mixtral_ckpt") + " --load " +
             path("mixtral_ckpt") + " --no-load-optim --no-load-rng --tensorboard-dir " +
             path("mixtral_tb") + " --wandb-project megaton --wandb-exp-name mixtral",
         {}});
}

TEST_F(LaunchScripts, DeepSeekV3) {
  check({"deepseek_v3",
         "--device cpu --distributed-timeout-minutes 60 --tensor-model-parallel-size 1 "
         "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
         "--context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
         "--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn "
         "--disable-bias-linear --micro-batch-size 1 --global-batch-size 2 --train-samples 6 "
         "--exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc "
         "--manual-gc-interval 10 --recompute-granularity selective --recompute-modules mlp moe "
         "layernorm --transformer-impl transformer_engine --seq-length 32 --data-cache-path " +
             path("ds_cache") + " --tokenizer-type HuggingFaceTokenizer --tokenizer-model " +
             kGolden + "qwen2 --mock-data --split 99,1,0 --no-mmap-bin-files "
             "--no-create-attention-mask-in-dataloader --num-workers 6 --num-layers 4 "
             "--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --kv-channels 8 "
             "--max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000 "
             "--make-vocab-size-divisible-by 32 --normalization RMSNorm --norm-epsilon 1e-6 "
             "--swiglu --untie-embeddings-and-output-weights --multi-latent-attention "
             "--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 "
             "--qk-layernorm --lr-decay-samples 6 --lr-warmup-samples 2 --lr-warmup-init 3.9e-7 "
             "--lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 "
             "--adam-beta2 0.95 --num-experts 8 --moe-layer-freq [0]*1+[1]*3 "
             "--moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 "
             "--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 "
             "--moe-token-dispatcher-type alltoall --moe-router-pre-softmax --moe-grouped-gemm "
             "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 "
             "--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid "
             "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
             "--moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing "
             "--q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
             "--v-head-dim 8 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 "
             "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 1 --eval-interval 2 "
             "--auto-detect-ckpt-format --load " + path("ds_ckpt") + " --save " +
             path("ds_ckpt") + " --save-interval 2 --dist-ckpt-strictness log_all "
             "--init-method-std 0.02 --log-timers-to-tensorboard --log-memory-to-tensorboard "
             "--log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard "
             "--log-throughput --log-interval 1 --tensorboard-dir " + path("ds_tb") +
             " --bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
             "--no-gradient-accumulation-fusion --calculate-per-token-loss "
             "--init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer "
             "--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16",
         {}});
}

}  // namespace
}  // namespace megaton
