//! Records the git commit the binary is built from, for `fencegate_build_info`
//! and `--version`: `FENCEGATE_COMMIT` when set (a build without `.git`, e.g. a
//! container), else `git rev-parse`, else "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    let commit = std::env::var("FENCEGATE_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=FENCEGATE_COMMIT={commit}");
    println!("cargo:rerun-if-env-changed=FENCEGATE_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
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
