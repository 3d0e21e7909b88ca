//! Stamps the binary with the git commit it is built from, for
//! `fencegate_build_info` and `--version` (read in `src/main.rs` only):
//! `FENCEGATE_COMMIT` when set (a build without `.git`, e.g. a container),
//! else — in a release build — `git rev-parse`, else "dev".
//!
//! Only a release build watches HEAD. A build script's rerun makes cargo
//! recompile every target of the package, the library and each test binary
//! included, whatever reads the stamp: watching HEAD in debug builds rebuilt
//! the whole test suite on every commit, even one that changed only a test. A
//! debug build says "dev" rather than a commit it would not keep current.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    let release = std::env::var("PROFILE").is_ok_and(|p| p == "release");
    let given = std::env::var("FENCEGATE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty());
    let commit = match (given, release) {
        (Some(c), _) => c,
        (None, true) => {
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
        (None, false) => "dev".to_owned(),
    };
    println!("cargo:rustc-env=FENCEGATE_COMMIT={commit}");
    println!("cargo:rerun-if-env-changed=FENCEGATE_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
    if !release {
        return;
    }
    // Run again when HEAD moves: HEAD itself, and the branch it points to.
    let mut watch = vec!["HEAD".to_owned()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(branch);
    }
    for w in watch {
        if let Some(path) = git(&["rev-parse", "--git-path", &w]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
}
