// Bad input to the `megaton` binary: one line naming the culprit, exit status 2, and
// nothing written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt/checkpoint.h"
#include "common/cli_testing.h"
#include "data/preprocess.h"

namespace fs = std::filesystem;

namespace megaton {
namespace {

// CliErrors, kModel, kMock: common/cli_testing.h.

TEST_F(CliErrors, UnknownConfigKey) {
  expect_user_error("train --config " + config(std::string(kModel) + "hiden-size: 3\n"),
                    "unknown key 'hiden-size'");
}

TEST_F(CliErrors, HiddenNotDivisibleByHeads) {
  expect_user_error(
      "train --config " + config("num-layers: 1\nhidden-size: 10\nnum-attention-heads: 3\n"),
      "hidden-size (10) is not divisible by num-attention-heads (3)");
}

TEST_F(CliErrors, TopKAboveExperts) {
  expect_user_error(
      "train --config " + config(std::string(kModel) + "num-experts: 2\nmoe-router-topk: 3\n"),
      "moe-router-topk (3) must be between 1 and num-experts (2)");
}

// Megatron's router configuration checks, one line each.
TEST_F(CliErrors, RouterOptionsThatClash) {
  const std::string moe = std::string(kModel) + "num-experts: 4\n";
  const std::pair<const char*, const char*> cases[] = {
      {"moe-router-topk: 1\n",
       "moe-router-topk 1 with the softmax score function needs moe-router-pre-softmax"},
      {"moe-router-enable-expert-bias: true\n",
       "moe-router-enable-expert-bias needs moe-router-score-function sigmoid or sqrtsoftplus"},
      {"moe-router-num-groups: 3\nmoe-router-group-topk: 1\n",
       "num-experts (4) is not divisible by moe-router-num-groups (3)"},
      {"moe-router-num-groups: 2\nmoe-router-group-topk: 3\n",
       "moe-router-group-topk (3) must be between 1 and moe-router-num-groups (2)"},
      {"moe-router-score-function: relu\n",
       "moe-router-score-function must be softmax, sigmoid or sqrtsoftplus (got 'relu')"},
      {"moe-router-load-balancing-type: [aux_loss, z]\n",
       "moe-router-load-balancing-type 'z' must be aux_loss, seq_aux_loss, global_aux_loss"},
      {"moe-router-load-balancing-type: [aux_loss, seq_aux_loss]\nmoe-aux-loss-coeff: [1, 2, 3]\n",
       "moe-aux-loss-coeff has 3 values for 2 moe-router-load-balancing-type values"},
      {"moe-layer-freq: '[0]*1+[1]*3'\n", "moe-layer-freq pattern has 4 entries for num-layers 1"},
      {"moe-layer-freq: '[0]*'\n", "option 'moe-layer-freq': cannot read pattern '[0]*'"},
      {"moe-shared-expert-gate: true\n", "moe-shared-expert-gate needs a shared expert"},
      {"moe-pad-expert-input-to-capacity: true\n",
       "moe-pad-expert-input-to-capacity needs moe-expert-capacity-factor"},
      {"moe-expert-capacity-factor: 1.0\nmoe-token-drop-policy: random\n",
       "moe-token-drop-policy must be probs or position (got 'random')"},
  };
  for (const auto& [lines, message] : cases) {
    SCOPED_TRACE(lines);
    expect_user_error("train --config " + config(moe + lines), message);
  }
}

// Megatron: a --load directory without a checkpoint starts from random weights (with a
// warning), the first run of a script that saves and loads one directory; with
// --exit-on-missing-checkpoint it is an error naming the directory.
TEST_F(CliErrors, MissingCheckpoint) {
  const std::string nope = (dir / "nope").string();
  expect_user_error(
      "train --config " + config(kModel) + " --load " + nope + " --exit-on-missing-checkpoint",
      nope);
  EXPECT_EQ(run("train --config " + config(kModel) + " --load " + nope), 0);
}

TEST_F(CliErrors, MissingIndexFile) {
  fs::remove(prefix + ".idx");
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, CorruptIndexMagic) {
  {
    std::fstream f(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.write("NOTANIDX", 8);
  }
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, TruncatedIndex) {
  fs::resize_file(prefix + ".idx", fs::file_size(prefix + ".idx") - 5);
  expect_user_error("train --config " + config(kModel), prefix + ".idx");
}

TEST_F(CliErrors, BadFlagValue) {
  expect_user_error("train --config " + config(kModel) + " --lr fast", "'lr'");
}

// DeepSeek-V3 layers (issue 20): inconsistent MLA dims, YaRN without a factor, MTP limits
// or without MLA, one line and exit 2 each.
TEST_F(CliErrors, DeepSeekV3Flags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--position-embedding-type rope --multi-latent-attention --group-query-attention",
       "multi-latent-attention does not take group-query-attention"},
      {"--position-embedding-type rope --multi-latent-attention --rope-type yarn",
       "rope-type yarn needs rotary-scaling-factor"},
      {"--position-embedding-type rope --multi-latent-attention --qk-pos-emb-head-dim 7",
       "qk-pos-emb-head-dim (7) must be even for rope"},
      {"--position-embedding-type rope --multi-latent-attention --v-head-dim 0",
       "v-head-dim must be positive with multi-latent-attention"},
      {"--position-embedding-type rope --q-lora-rank 8",
       "q-lora-rank, kv-lora-rank, qk-head-dim, qk-pos-emb-head-dim and v-head-dim need "
       "multi-latent-attention"},
      {"--position-embedding-type rope --rope-type yarn --rotary-scaling-factor 4",
       "rope-type yarn needs multi-latent-attention"},
      {"--multi-latent-attention", "multi-latent-attention needs position-embedding-type rope"},
      {"--position-embedding-type rope --multi-latent-attention --kv-lora-rank 20 "
       "--fp8-format hybrid --micro-batch-size 2 --seq-length 16",
       "kv-lora-rank (20) must be divisible by 16 for FP8 GEMMs"},
      // Multi-token prediction.
      {"--mtp-num-layers 1", "mtp-num-layers needs position-embedding-type rope"},
      {"--position-embedding-type rope --mtp-num-layers -1", "mtp-num-layers must be >= 0"},
      {"--position-embedding-type rope --mtp-num-layers 1 --mtp-loss-scaling-factor -0.1",
       "mtp-loss-scaling-factor must be >= 0"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// Megatron's recompute checks (TransformerConfig.__post_init__), one line and exit 2 each.
TEST_F(CliErrors, RecomputeFlags) {
  const std::pair<const char*, const char*> cases[] = {
      {"--recompute-granularity partial",
       "recompute-granularity must be full or selective (got 'partial')"},
      {"--recompute-granularity full --recompute-num-layers 1",
       "recompute-granularity full needs recompute-method uniform or block"},
      {"--recompute-granularity full --recompute-method uniform",
       "recompute-granularity full needs recompute-num-layers between 1 and the layers of a "
       "pipeline stage (1)"},
      {"--recompute-granularity full --recompute-method block --recompute-num-layers 2",
       "recompute-num-layers between 1 and the layers of a pipeline stage (1) (got 2)"},
      {"--recompute-granularity selective --recompute-method uniform",
       "recompute-method applies to recompute-granularity full, not selective"},
      {"--recompute-granularity selective --recompute-num-layers 1",
       "recompute-num-layers applies to recompute-granularity full, not selective"},
      {"--recompute-granularity selective --recompute-modules core_attn attn",
       "recompute-modules: 'attn' is not one of core_attn, moe_act, layernorm, mlp, moe, "
       "shared_experts, mla_up_proj"},
      {"--recompute-granularity selective --recompute-modules mla_up_proj",
       "recompute-modules: mla_up_proj needs multi-latent-attention"},
      {"--moe-layer-recompute --recompute-granularity full --recompute-method block "
       "--recompute-num-layers 1",
       "moe-layer-recompute cannot be combined with recompute-granularity full"},
      {"--fp8-format hybrid --recompute-granularity selective --recompute-modules mlp",
       "not supported with fp8-recipe delayed"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(kModel) + " " + flags, needle);
}

// Megatron's CPU offloading checks (TransformerConfig.__post_init__), one line and exit 2
// each; Megatron has no flag for offloading weights (cpu_offloading_weights is not on its
// command line), nor has Megaton.
TEST_F(CliErrors, CpuOffloadingFlags) {
  const std::string two_layers = "num-layers: 2\nhidden-size: 16\nnum-attention-heads: 2\n";
  const std::pair<const char*, const char*> cases[] = {
      {"--cpu-offloading-num-layers 2",
       "CPU offloading can be done only for layers less than num-layers (2): "
       "cpu-offloading-num-layers is 2"},
      {"--cpu-offloading --cpu-offloading-num-layers -1",
       "CPU offloading can be done only for layers less than num-layers (2): "
       "cpu-offloading-num-layers is -1"},
      {"--cpu-offloading-num-layers 1 --pipeline-model-parallel-size 2",
       "Currently there is no support for Pipeline parallelism with CPU offloading"},
      {"--cpu-offloading --recompute-activations",
       "CPU offloading does not work when activation recomputation is enabled"},
      {"--cpu-offloading-num-layers 1 --recompute-granularity full --recompute-method block "
       "--recompute-num-layers 1",
       "CPU offloading does not work when activation recomputation is enabled"},
      {"--cpu-offloading-num-layers 1 --cuda-graph-impl full_iteration",
       "cpu-offloading with cuda-graph-impl full_iteration is not supported in Megaton yet"},
      {"--cpu-offloading-num-layers 1 --cpu-offloading-weights", "--cpu-offloading-weights"},
  };
  for (const auto& [flags, needle] : cases)
    expect_user_error("train --config " + config(two_layers) + " " + flags, needle);
}

TEST_F(CliErrors, BadAlltoAllExchangeSetting) {
  expect_user_error("train --config " + config(std::string(kModel) + "num-experts: 4\n"),
                    "MEGATON_MOE_ALLTOALL_EXCHANGE must be auto, regroup or pull (got 'yes')",
                    "MEGATON_MOE_ALLTOALL_EXCHANGE=yes");
}

TEST_F(CliErrors, MissingConfigFile) {
  expect_user_error("train --config " + (dir / "absent.yaml").string(),
                    (dir / "absent.yaml").string());
}

// Class 3 of the reliability issue: non-finite hyperparameters are refused at parse time.
TEST_F(CliErrors, NonFiniteFloatFlags) {
  for (const char* flag : {"--weight-decay nan", "--lr inf", "--adam-eps -inf", "--clip-grad nan",
                           "--init-method-std nan", "--moe-aux-loss-coeff nan"}) {
    SCOPED_TRACE(flag);
    expect_user_error(kMock + " --train-iters 3 " + flag, "must be");
  }
}

// A run with offloading trains (the flag reaches the model; the CPU backend copies into
// host buffers of its own).
TEST_F(CliErrors, CpuOffloadingTrains) {
  EXPECT_EQ(run(kMock + " --train-iters 2 --cpu-offloading-num-layers 1"), 0)
      << (stderr_lines.empty() ? "" : stderr_lines.back());
}

// Class 4: values that used to reach internal checks ("internal error", exit 1).
TEST_F(CliErrors, OutOfRangeValuesNameTheFlag) {
  const std::pair<const char*, const char*> cases[] = {
      {"--adam-beta1 1.5", "option 'adam-beta1' must be in [0, 1) (got 1.5)"},
      {"--adam-beta2 -0.1", "option 'adam-beta2' must be in [0, 1)"},
      {"--position-embedding-type rope --rotary-base 0", "option 'rotary-base' must be > 0"},
      {"--ffn-hidden-size -5", "option 'ffn-hidden-size' must be > 0 (got -5)"},
      {"--kv-channels -8", "option 'kv-channels' must be > 0"},
      {"--global-batch-size -4", "global-batch-size must be positive (got -4)"},
      {"--clip-grad -1", "option 'clip-grad' must be >= 0 (got -1)"},
      {"--seed -3", "option 'seed' must be >= 0"},
      {"--moe-router-topk-scaling-factor -1 --num-experts 4",
       "option 'moe-router-topk-scaling-factor' must be >= 0"},
      {"--num-query-groups 99999999999", "option 'num-query-groups' must be at most 2147483647"},
      {"--exit-interval -1", "exit-interval must be >= 0"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    expect_user_error(kMock + " --train-iters 3 " + flags, message);
  }
}

// Class 5: silently accepted nonsense.
TEST_F(CliErrors, DuplicateConfigKey) {
  // The same option under both spellings counts as a duplicate too.
  expect_user_error("train --config " + config(std::string(kModel) + "num_layers: 2\n"),
                    "key 'num-layers' is given twice (line 4)");
}

TEST_F(CliErrors, MockDataWithDataPath) {
  expect_user_error("train --config " + config(kModel) + " --mock-data",
                    "mock-data trains on random tokens: it takes no data-path");
}

// Class 8: messages about the config file itself.
TEST_F(CliErrors, ConfigIsADirectory) {
  expect_user_error("train --config " + dir.string(), "is a directory, expected a YAML file");
}

TEST_F(CliErrors, BinaryConfigIsNamedNotEchoed) {
  {
    std::ofstream out(dir / "binary.yaml", std::ios::binary);
    const char bytes[] = {'\x1b', '[', '2', 'J', '\0', '\x07', 'x', ':', ' ', '1', '\n'};
    out.write(bytes, sizeof(bytes));
  }
  expect_user_error("train --config " + (dir / "binary.yaml").string(),
                    "is not a text file (byte 0x1b at offset 0)");
  for (char c : stderr_lines[0]) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "raw byte " << int(c);
}

// Class 6: an unwritable --save is found at start-up, before any iteration runs.
TEST_F(CliErrors, UnwritableSaveFailsAtStartup) {
  std::ofstream(dir / "a_file") << "x";
  const std::string save = (dir / "a_file" / "ckpt").string();
  fs::path out = dir / "stdout.txt";
  int rc = run(kMock + " --train-iters 3 --save " + save + " > " + out.string());
  EXPECT_EQ(rc, 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  EXPECT_NE(stderr_lines[0].find("a_file"), std::string::npos) << stderr_lines[0];
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text.find("iteration"), std::string::npos) << "trained before failing: " << text;
}

// Reads every F32 tensor of the checkpoint `save` names and checks each is finite.
::testing::AssertionResult checkpoint_is_finite(const fs::path& save, int64_t iteration) {
  std::ifstream tracker(save / "latest_checkpointed_iteration.txt");
  int64_t latest = -1;
  tracker >> latest;
  if (latest != iteration)
    return ::testing::AssertionFailure()
           << "tracker names " << latest << ", expected " << iteration;
  ckpt::LoadedCheckpoint ck = ckpt::load_checkpoint(save.string());
  for (const auto& [name, t] : ck.tensors) {
    if (t.dtype() != DType::F32) continue;
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(t.f32()[i]))
        return ::testing::AssertionFailure() << name << "[" << i << "] = " << t.f32()[i];
  }
  return ::testing::AssertionSuccess();
}

// Class 3: a diverging run (lr 1e30: Adam moves every weight by ~1e30, so the second
// forward overflows) stops at the first non-finite loss, naming the iteration and rank,
// and its last checkpoint (iteration 1) is finite.
TEST_F(CliErrors, DivergingRunStopsAndItsLastCheckpointIsFinite) {
  const fs::path save = dir / "save";
  int rc = run(kMock + " --train-iters 3 --lr 1e30 --save-interval 1 --save " + save.string());
  EXPECT_EQ(rc, 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  EXPECT_NE(stderr_lines[0].find("iteration 2: found NaN in the loss on rank 0"), std::string::npos)
      << stderr_lines[0];
  EXPECT_TRUE(checkpoint_is_finite(save, 1));
  EXPECT_FALSE(fs::exists(save / "iter_0000002"));
}

// Without the check, a non-finite step is skipped and counted, and the run ends normally.
TEST_F(CliErrors, NoCheckForNanSkipsTheStep) {
  const fs::path save = dir / "save";
  int rc = run(kMock + " --train-iters 3 --lr 1e30 --no-check-for-nan-in-loss-and-grad --save " +
               save.string());
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(checkpoint_is_finite(save, 3));
}

// Class 3: a save refuses parameters that are not finite, so the tracker never names such a
// checkpoint. lr x weight decay = 3e39 overflows fp32 in AdamW's decoupled decay, making
// every weight infinite after the first update while its loss was still finite.
TEST_F(CliErrors, SaveRefusesNonFiniteParameters) {
  const fs::path save = dir / "save";
  int rc = run(kMock + " --train-iters 3 --lr 3e38 --weight-decay 10 --save-interval 1 --save " +
               save.string());
  EXPECT_EQ(rc, 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  EXPECT_NE(stderr_lines[0].find("not saving iteration 1"), std::string::npos) << stderr_lines[0];
  EXPECT_FALSE(fs::exists(save / "latest_checkpointed_iteration.txt"));
  EXPECT_FALSE(fs::exists(save / "iter_0000001"));
}

// Class 5: checkpoint metadata whose iteration disagrees with its directory.
TEST_F(CliErrors, CheckpointIterationDisagreesWithDirectory) {
  const fs::path save = dir / "ck";
  ASSERT_EQ(run(kMock + " --train-iters 1 --save " + save.string()), 0);
  const fs::path meta = save / "iter_0000001" / "metadata.json";
  std::ifstream in(meta);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  in.close();
  const size_t at = text.find("\"iteration\": 1");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 200);
  text.replace(at, 14, "\"iteration\": 7");
  std::ofstream(meta) << text;
  expect_user_error(kMock + " --train-iters 3 --load " + save.string(),
                    "says iteration 7, but its directory");
}

// Class 6: the partial saves of killed processes are removed by the next save; those of a
// live process are kept.
TEST_F(CliErrors, StalePartialSavesAreRemoved) {
  const fs::path save = dir / "ck";
  fs::create_directories(save / "iter_0000001.tmp999999999");  // no such PID (> pid_max)
  std::ofstream(save / "iter_0000001.tmp999999999" / "model_optim_rng.safetensors") << "partial";
  const std::string live = "iter_0000001.tmp" + std::to_string(::getpid());
  fs::create_directories(save / live);
  ASSERT_EQ(run(kMock + " --train-iters 1 --save " + save.string()), 0);
  EXPECT_FALSE(fs::exists(save / "iter_0000001.tmp999999999"));
  EXPECT_TRUE(fs::exists(save / live));
  EXPECT_TRUE(fs::exists(save / "iter_0000001" / "metadata.json"));
}

// ---- Class 2: memory and threads -----------------------------------------------------

// A run whose sizes cannot fit fails in seconds, before allocating, with the flag and the
// bytes needed against the bytes available; under `ulimit -v` the address space is the
// limit named.
TEST_F(CliErrors, MemoryBoundRunFailsInSecondsUnderUlimit) {
  const auto start = std::chrono::steady_clock::now();
  // 4 GiB of address space: room for the program and its libraries, not for 256 x 4096
  // tokens of activations (about 7 GB).
  const int rc =
      run("train --device cpu --mock-data --tokenizer-type NullTokenizer "
          "--vocab-size 100 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
          "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 256 "
          "--train-iters 1 --eval-iters 0 --save " +
              (dir / "save").string(),
          "", "ulimit -v 4194304;");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(rc, 2);
  ASSERT_EQ(stderr_lines.size(), 1u);
  const std::string& line = stderr_lines[0];
  EXPECT_NE(line.find("micro-batch-size 256 x seq-length 4096"), std::string::npos) << line;
  EXPECT_NE(line.find(" bytes) of address space is available (ulimit -v"), std::string::npos)
      << line;
  EXPECT_LT(seconds, 20.0);
  EXPECT_FALSE(fs::exists(dir / "save"));
}

// Without a ulimit: a model of petabytes is refused against the host's memory.
TEST_F(CliErrors, ModelLargerThanTheHostIsRefusedBeforeAllocating) {
  expect_user_error(
      "train --device cpu --mock-data --tokenizer-type NullTokenizer "
      "--vocab-size 100 --num-layers 64 --hidden-size 1000000 "
      "--num-attention-heads 2 --seq-length 8 --train-iters 1 --eval-iters 0",
      "num-layers 64 x hidden-size 1000000 (ffn-hidden-size 4000000): the parameters");
  EXPECT_NE(stderr_lines[0].find("of host memory is available"), std::string::npos)
      << stderr_lines[0];
}

// preprocess --workers beyond the cap: one line, status 2, no temporary files.
TEST_F(CliErrors, PreprocessWorkersAreBounded) {
  const std::string args = "preprocess --input " + (dir / "corpus.jsonl").string() +
                           " --output-prefix " + (dir / "out").string() +
                           " --tokenizer-type ByteTokenizer --workers ";
  for (const char* workers : {"1000000000", "0", "-3"}) {
    SCOPED_TRACE(workers);
    EXPECT_EQ(run(args + workers), 2);
    ASSERT_EQ(stderr_lines.size(), 1u);
    EXPECT_NE(stderr_lines[0].find("--workers"), std::string::npos) << stderr_lines[0];
  }
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().rfind("out", 0), std::string::npos)
        << "left behind: " << entry.path();
}

// Class 5: an input without tokens writes nothing and says so.
TEST_F(CliErrors, PreprocessOfAnEmptyInputIsRefused) {
  std::ofstream(dir / "empty.jsonl") << "";
  std::ofstream(dir / "blank.jsonl") << "{\"text\": \"\"}\n{\"text\": \"\"}\n";
  for (const char* input : {"empty.jsonl", "blank.jsonl"}) {
    SCOPED_TRACE(input);
    EXPECT_EQ(run("preprocess --input " + (dir / input).string() + " --output-prefix " +
                  (dir / "out").string() + " --tokenizer-type ByteTokenizer --no-append-eod"),
              2);
    ASSERT_EQ(stderr_lines.size(), 1u);
    EXPECT_NE(stderr_lines[0].find("nothing written"), std::string::npos) << stderr_lines[0];
  }
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().rfind("out", 0), std::string::npos)
        << "left behind: " << entry.path();
}

// Class 8: an .idx header whose counts overflow 64-bit size arithmetic names the true size.
TEST_F(CliErrors, IndexWithAHugeCountNamesTheBytesNeeded) {
  {
    std::fstream f(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(18);  // the sequence count, after magic (9), version (8) and dtype (1)
    const uint64_t huge = uint64_t(1) << 62;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  // 34 + 12 x 2^62 + 8 x 3 = 55340232221128654906 bytes (> 2^64).
  expect_user_error("train --config " + config(kModel), "need 55340232221128654906 bytes");
}

// ---- FP8 flags (issue 16) --------------------------------------------------------------

TEST_F(CliErrors, Fp8BadRecipesAndDimensions) {
  const std::string fp8 = kMock + " --train-iters 1 --fp8-format e4m3";
  const std::pair<std::string, std::string> cases[] = {
      {fp8 + " --fp8-recipe fast", "option 'fp8-recipe' must be delayed, tensorwise or blockwise"},
      {fp8 + " --fp8-recipe mxfp8", "mxfp8 needs Blackwell's block-scaled tensor cores"},
      {fp8 + " --fp8-recipe nvfp4", "nvfp4 needs Blackwell's block-scaled tensor cores"},
      {kMock + " --train-iters 1 --fp8-format e5m2", "option 'fp8-format' must be e4m3 or hybrid"},
      {kMock + " --train-iters 1 --fp8-recipe tensorwise",
       "option 'fp8-recipe' needs --fp8-format"},
      // kMock: hidden 16, micro-batch 2 x seq 8 = 16 tokens; heads 2 x 8 = 16.
      {fp8 + " --fp8-recipe blockwise",
       "micro-batch-size x seq-length (16) must be divisible by 128"},
      {fp8 + " --ffn-hidden-size 40", "ffn-hidden-size (40) must be divisible by 16 for FP8 GEMMs"},
      {fp8 + " --fp8-amax-compute-algo mean",
       "option 'fp8-amax-compute-algo' must be max or most_recent"},
      {fp8 + " --fp8-margin -1", "option 'fp8-margin' must be >= 0"},
      {fp8 + " --first-last-layers-bf16",
       "first-last-layers-bf16 needs --fp8-recipe tensorwise or blockwise"},
      {fp8 + " --fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 2",
       "num-layers-at-start-in-bf16 (2) + num-layers-at-end-in-bf16 (1) exceed num-layers (2)"},
      {fp8 + " --fp8-param-gather", "fp8-param-gather needs use-distributed-optimizer"},
      {fp8 + " --fp8-recipe blockwise --fp8-param-gather --use-distributed-optimizer",
       "fp8-param-gather is not available with --fp8-recipe blockwise"},
      {kMock + " --train-iters 1 --moe-router-padding-for-fp8",
       "option 'moe-router-padding-for-fp8' needs --fp8-format"},
      {kMock + " --train-iters 1 --fp8-param-gather",
       "option 'fp8-param-gather' needs --fp8-format"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    expect_user_error(flags, message);
  }
}

// --deterministic-mode takes NCCL_ALGO from the environment when set (Megatron's list),
// else sets Ring; any other algorithm is refused.
TEST_F(CliErrors, DeterministicModeRefusesAnOtherNcclAlgorithm) {
  expect_user_error(kMock + " --train-iters 1 --deterministic-mode",
                    "deterministic-mode needs NCCL_ALGO unset or one of", "NCCL_ALGO=NVLS");
  EXPECT_EQ(run(kMock + " --train-iters 1 --deterministic-mode", "NCCL_ALGO=Tree"), 0);
}

// Megatron's --moe-router-padding-for-fp8 is accepted: Megaton's experts always pad each
// expert's rows to the FP8 multiple, so the run trains and says once that the flag changes
// nothing.
TEST_F(CliErrors, RouterPaddingForFp8IsAcceptedWithANotice) {
  const std::string moe = kMock +
                          " --train-iters 1 --num-experts 2 --moe-router-topk 2 "
                          "--fp8-format hybrid --fp8-recipe tensorwise";
  EXPECT_EQ(run(moe + " --moe-router-padding-for-fp8"), 0);
  int notices = 0;
  for (const std::string& line : stderr_lines)
    if (line.rfind("no effect in Megaton: --moe-router-padding-for-fp8:", 0) == 0) ++notices;
  EXPECT_EQ(notices, 1);
}

}  // namespace
}  // namespace megaton
