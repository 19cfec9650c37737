// An output directory written under a temporary name beside it and renamed when complete,
// so an interrupted or failed write leaves nothing under the final name.
#pragma once
#include <string>

namespace megaton {

class StagedDirectory {
 public:
  // Checks that `final_dir` is absent or an empty directory (megaton::Error naming `flag`
  // and the path otherwise), creates its parent when missing, and makes the empty
  // directory <final_dir>.tmp<PID> (removing one left by a dead run of this PID).
  // Throws megaton::Error naming the path when it cannot be created.
  StagedDirectory(const std::string& final_dir, const std::string& flag);
  // Removes the temporary directory unless commit() ran.
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  const std::string& path() const { return tmp_; }          // write here
  const std::string& final_path() const { return final_; }  // absolute

  // Renames the temporary directory to the final one (an empty one there is removed
  // first) and flushes the parent directory. Throws megaton::Error naming the paths.
  void commit();

 private:
  std::string final_, tmp_, flag_;
  bool committed_ = false;
};

}  // namespace megaton
