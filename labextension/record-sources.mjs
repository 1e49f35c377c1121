// Writes prebuilt/sources.sha256: the SHA-256 of the files the build is made from, so a
// test can tell a committed build that is older than its sources (tests/test_labextension.py
// computes the same digest: for each file in SOURCES, its path, a NUL, its bytes, a NUL).
import { createHash } from "node:crypto";
import { readFileSync, writeFileSync } from "node:fs";

const SOURCES = ["package.json", "tsconfig.json", "src/index.ts"];
const hash = createHash("sha256");
for (const path of SOURCES) {
  hash.update(path);
  hash.update("\0");
  hash.update(readFileSync(path));
  hash.update("\0");
}
writeFileSync("prebuilt/sources.sha256", `${hash.digest("hex")}\n`);
