//! The README as a user meets it: the quick start's shell session runs as written
//! (against `config/fencegate.toml`, with `fencegate` on the PATH; only the three
//! ports are swapped for free ones), every relative link in README.md, docs/ and
//! benches/README.md resolves inside the repository, the README names the test
//! command CI runs, and the commands have help texts.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;

/// The `sh` block after the `<!-- quickstart` marker.
fn quickstart_block(readme: &str) -> String {
    let after = &readme[readme.find("<!-- quickstart").expect("quickstart marker")..];
    let start = after.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let len = after[start..].find("```").expect("block end");
    after[start..start + len].to_owned()
}

/// The quick start works end to end: worker 1's request and worker 2's reach the
/// origin at epochs 1 and 2, worker 1's late request is refused `epoch_stale` and
/// never arrives. Breaks if the example config points nowhere, a command or flag
/// in the session does not exist, or the printed epochs drift from a fresh store.
#[test]
fn the_quick_start_runs_as_written() {
    // The session uses curl, as a reader would; a machine without it cannot run it.
    if !Command::new("curl")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED the_quick_start_runs_as_written: curl is not on the PATH"
        );
        return;
    }
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("config")).unwrap();
    let (proxy, admin, origin) = (free_port(), free_port(), free_port());
    let ports = |t: &str| {
        t.replace(":8080", &format!(":{proxy}"))
            .replace(":9090", &format!(":{admin}"))
            .replace(":8081", &format!(":{origin}"))
    };
    let config = std::fs::read_to_string(root.join("config/fencegate.toml")).unwrap();
    std::fs::write(dir.path().join("config/fencegate.toml"), ports(&config)).unwrap();
    let script = ports(&quickstart_block(&readme)).replace(
        "fencegate origin &",
        &format!("fencegate origin --listen 127.0.0.1:{origin} &"),
    );
    let bin_dir = Path::new(bin()).parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // Twice in a row, as a reader who runs it again would (issue 45): the second
    // run starts clean and tells the same story.
    let script = format!("{script}\necho '=== again'\n{script}");
    let mut child = Command::new("bash")
        .args(["-e", "-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        .env("FENCEGATE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let pgid = child.id();
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Whatever happened, nothing the session started outlives the test.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .status();
    let mut out = String::new();
    let mut err = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = status.unwrap_or_else(|| panic!("the session hung\n{out}\n{err}"));
    assert!(
        status.success(),
        "{status}\n--- stdout\n{out}\n--- stderr\n{err}"
    );
    let runs: Vec<&str> = out.split("=== again").collect();
    assert_eq!(runs.len(), 2, "{out}");
    for out in runs {
        assert!(
            out.contains("#1 POST /v1/charges epoch=1 "),
            "worker 1 at epoch 1:\n{out}"
        );
        assert!(
            out.contains("#2 POST /v1/charges epoch=2 "),
            "worker 2 at epoch 2:\n{out}"
        );
        assert!(!out.contains("#3 "), "the late request arrived:\n{out}");
        assert_eq!(out.matches("-> 200").count(), 2, "{out}");
        assert!(
            !out.contains("replayed"),
            "a replay of an earlier run:\n{out}"
        );
        assert!(
            out.contains("\"error\":\"epoch_stale\"") && out.contains("-> 409"),
            "{out}"
        );
    }
}

/// The documents a reader is sent to: the README, everything under `docs/`, and
/// the benchmarks' README.
fn doc_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut files = vec![root.join("README.md"), root.join("benches/README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The text outside fenced code blocks.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        } else if !in_code {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The anchors GitHub makes for a file's headings: lower case, punctuation
/// dropped, spaces as hyphens, `-1`, `-2`… on repeats.
fn anchors(text: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for line in prose(text).lines() {
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        let title = title.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                '-' | '_' => Some(c),
                c if c.is_alphanumeric() => Some(c),
                _ => None,
            })
            .flat_map(char::to_lowercase)
            .collect();
        let repeats = counts.entry(slug.clone()).or_insert(0);
        seen.push(if *repeats == 0 {
            slug
        } else {
            format!("{slug}-{repeats}")
        });
        *repeats += 1;
    }
    seen
}

/// Every relative link in README.md, docs/*.md and benches/README.md resolves:
/// a markdown link (relative to its file, as GitHub reads it) names a file or
/// directory in the repository, and its `#anchor`, when it points into a
/// markdown file, names a heading there; a file path quoted in backticks (a file
/// a reader is told to open, relative to the repository's root) exists. Breaks on
/// a link to a file a clone does not have (SPEC.md, NOTES.md and a bench README
/// once were), or to a section that was renamed or moved.
#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = repo_root();
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in doc_files(&root) {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
        let dir = file.parent().unwrap();
        let mut check = |base: &Path, target: &str| {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                return;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target, None),
            };
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                base.join(path)
            };
            if !resolved.exists() {
                missing.push(format!("{name}: {target}"));
                return;
            }
            if let Some(anchor) = anchor {
                if resolved.extension().is_some_and(|e| e == "md") {
                    let there = std::fs::read_to_string(&resolved).unwrap();
                    if !anchors(&there).iter().any(|a| a == anchor) {
                        missing.push(format!("{name}: {target} (no such heading)"));
                    }
                }
            }
        };
        for part in prose(&text).split("](").skip(1) {
            if let Some(end) = part.find(')') {
                check(dir, &part[..end]);
            }
        }
        // `path/to/file.ext` in backticks: a file a reader is told to open.
        for (i, quoted) in text.split('`').enumerate() {
            let file_like = i % 2 == 1
                && !quoted.contains(char::is_whitespace)
                && !quoted.starts_with('/')
                && !quoted.contains(['{', '*', '$', '<', '='])
                && [".md", ".rs", ".toml", ".sh", ".py"]
                    .iter()
                    .any(|ext| quoted.ends_with(ext))
                && (quoted.contains('/') || quoted.ends_with(".md"));
            if file_like {
                check(&root, quoted);
            }
        }
    }
    assert!(checked >= 50, "found only {checked} links");
    assert!(
        missing.is_empty(),
        "links that do not resolve: {missing:#?}"
    );
    for f in ["LICENSE", "SPEC.md"] {
        assert!(root.join(f).is_file(), "{f}");
    }
    assert!(
        !root.join("scripts/__pycache__").exists()
            || !Command::new("git")
                .args(["ls-files", "--error-unmatch", "scripts/__pycache__"])
                .current_dir(&root)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
        "no committed __pycache__"
    );
}

/// The README's test command is the one CI runs. Breaks when either changes
/// without the other.
#[test]
fn the_readme_names_the_test_command_ci_runs() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    let command = "bash scripts/test.sh";
    assert!(
        ci.lines().any(|l| !l.trim_start().starts_with('#')
            && !l.contains("step ")
            && l.contains(command)),
        ".ci/run no longer runs `{command}`"
    );
    assert!(
        readme.lines().any(|l| l.starts_with(command)),
        "the README's sh block does not name `{command}`"
    );
}

/// Every command and option has a help text.
#[test]
fn every_command_has_help() {
    let help = |args: &[&str]| {
        let o = Command::new(bin()).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let top = help(&["--help"]);
    for cmd in ["serve", "check-config", "lease", "demo", "origin"] {
        let line = top
            .lines()
            .find(|l| l.trim_start().starts_with(cmd))
            .unwrap_or_else(|| panic!("{cmd} in {top}"));
        assert!(line.split_whitespace().count() > 2, "{line}");
    }
    for args in [
        &["serve", "--help"][..],
        &["check-config", "--help"],
        &["origin", "--help"],
        &["lease", "renew", "--help"],
        &["lease", "release", "--help"],
        &["lease", "show", "--help"],
        &["lease", "acquire", "--help"],
        &["demo", "--help"],
    ] {
        let text = help(args);
        for line in text.lines().filter(|l| l.trim_start().starts_with("--")) {
            if line.trim_start().starts_with("--help") {
                continue;
            }
            assert!(
                line.split_whitespace().count() > 2,
                "{args:?}: {line} has no help text"
            );
        }
    }
    assert!(
        help(&["--version"]).contains('('),
        "the commit in --version"
    );
}

/// The minimum Rust the README and Cargo.toml state is the real one: no locked
/// dependency built on Linux declares a higher `rust-version` (21 aws crates
/// declared 1.94.1 while both said 1.85), and the README says the same version.
#[test]
fn the_stated_rust_version_is_the_real_minimum() {
    let root = repo_root();
    let manifest: toml::Table =
        toml::from_str(&std::fs::read_to_string(root.join("Cargo.toml")).unwrap()).unwrap();
    let ours = manifest["package"]["rust-version"]
        .as_str()
        .unwrap()
        .to_owned();
    let version = |v: &str| -> Vec<u64> { v.split('.').map(|p| p.parse().unwrap()).collect() };
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["metadata", "--format-version", "1", "--locked"])
        .args(["--filter-platform", "x86_64-unknown-linux-gnu"])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let used: std::collections::HashSet<&str> = meta["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["id"].as_str())
        .collect();
    let higher: Vec<String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| used.contains(id)))
        .filter_map(|p| {
            let rv = p["rust_version"].as_str()?;
            (version(rv) > version(&ours))
                .then(|| format!("{} {} needs {rv}", p["name"], p["version"]))
        })
        .collect();
    assert!(
        higher.is_empty(),
        "rust-version {ours} is below: {higher:?}"
    );
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains(&format!("Rust {ours}+")),
        "the README states another minimum than Cargo.toml's {ours}"
    );
    assert!(readme.contains("cargo install --path . --locked"));
}
