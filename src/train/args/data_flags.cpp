// Data flags: the dataset blend (--data-path, its file form, per-split blends), the split,
// mock data, the index cache, the end-of-document loss mask and the packed documents'
// positions and attention mask (Megatron's "data and dataloader" group).
#include "core/error.h"
#include "core/printable.h"
#include "data/data_args.h"
#include "train/args/flag_table.h"

namespace megaton {

namespace {

void parse_data(const ArgReader& r, TrainArgs& a) {
  if (r.has("data-path")) a.data_path = r.raw.at("data-path");
  if (r.has("data-args-path")) {
    if (r.has("data-path"))
      fail("data-path and data-args-path exclude each other: give one (Megatron asserts it)");
    a.data_path = data::read_data_args_path(r.one("data-args-path"));
  }
  const char* split_flags[] = {"train-data-path", "valid-data-path", "test-data-path"};
  bool per_split_flags = false;
  for (int s = 0; s < 3; ++s)
    if (r.has(split_flags[s])) {
      a.per_split_data_path[s] = r.raw.at(split_flags[s]);
      per_split_flags = true;
    }
  if (r.has("per-split-data-args-path")) {
    if (per_split_flags)
      fail(
          "per-split-data-args-path and train/valid/test-data-path exclude each other: give "
          "one (Megatron asserts it)");
    auto splits = data::read_per_split_data_args_path(r.one("per-split-data-args-path"));
    for (int s = 0; s < 3; ++s)
      if (splits[s]) a.per_split_data_path[s] = *splits[s];
    per_split_flags = true;
  }
  if (per_split_flags && !a.data_path.empty())
    fail("data-path (or data-args-path) and per-split data paths exclude each other: give one");
  if (per_split_flags && a.per_split_data_path[0].empty())
    fail("per-split data paths need a train blend (train-data-path or the JSON's 'train')");
  r.get("split", a.split);
  r.get("mock-data", a.mock_data);
  r.get("eod-mask-loss", a.eod_mask_loss);
  r.get("reset-position-ids", a.reset_position_ids);
  r.get("reset-attention-mask", a.reset_attention_mask);
  r.get("data-cache-path", a.data_cache_path);
  std::string loader = "single";
  r.get("dataloader-type", loader);
  if (loader != "single")
    fail(
        "dataloader-type {} is not supported in Megaton: it reads samples in order "
        "(Megatron's single sampler)",
        printable(loader));
  double surplus = 0.005;
  r.get("mid-level-dataset-surplus", surplus);
  if (surplus != 0.005)
    fail(
        "mid-level-dataset-surplus {} is not supported in Megaton: blends ask each dataset "
        "for Megatron's default 0.5% surplus",
        surplus);
  const bool any_data = !a.data_path.empty() || per_split_flags;
  if (a.mock_data && any_data)
    fail("mock-data trains on random tokens: it takes no data-path (got '{}')",
         printable(!a.data_path.empty() ? a.data_path[0] : a.per_split_data_path[0].at(0)));
}

}  // namespace

std::vector<OptionSpec> data_megatron_rules();

ArgGroup data_flags() {
  ArgGroup g{"data", "data", {}, parse_data};
  g.flags = {
      values("data-path", "one prefix, or weight prefix weight prefix ..."),
      flag("data-args-path", "a file holding what --data-path would (Megatron's format)"),
      values("train-data-path", "the training blend (prefix, or weight prefix pairs), used whole"),
      values("valid-data-path", "the validation blend, used whole"),
      values("test-data-path", "the test blend, used whole"),
      flag("per-split-data-args-path",
           "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} of per-split blends"),
      flag("split", "train,valid,test proportions of documents"),
      toggle("mock-data", "train on random tokens (throughput runs; no data-path)"),
      flag("data-cache-path", "directory for the dataset index caches (default: beside each .idx)"),
      flag("dataloader-type",
           "single (samples in order; Megatron's cyclic and external are "
           "not supported)"),
      flag("mid-level-dataset-surplus", "Megatron's blend surplus; only its default 0.005"),
      toggle("eod-mask-loss",
             "leave the predictions made at end-of-document input tokens out of the loss"),
      toggle("reset-position-ids",
             "restart the positions (RoPE) at 0 after each end-of-document token"),
      toggle("reset-attention-mask",
             "documents packed in a sample attend within themselves only (eod ends one)"),
  };
  for (OptionSpec& s : data_megatron_rules()) g.flags.push_back(std::move(s));
  return g;
}

}  // namespace megaton
