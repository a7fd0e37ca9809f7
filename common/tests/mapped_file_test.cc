#include "kvr/common/mapped_file.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace kvr {
namespace {

TEST(MappedFileTest, MapsContents) {
  const std::string path = ::testing::TempDir() + "/mapped_file_test.bin";
  {
    std::ofstream out(path, std::ios::binary);
    out << "hello";
  }
  auto file = MappedFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file->data()), 5), "hello");
  MappedFile moved = std::move(*file);
  EXPECT_EQ(moved.size(), 5u);
  std::remove(path.c_str());
}

TEST(MappedFileTest, MissingFileIsNotFoundAndNamesPath) {
  auto file = MappedFile::Open("/nonexistent/kvr/file.gguf");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find("/nonexistent/kvr/file.gguf"), std::string::npos);
}

}  // namespace
}  // namespace kvr
