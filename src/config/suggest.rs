//! "Did you mean": the nearest known key for an unknown one.

/// serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant")
/// with the closest expected name added: "… — did you mean `a`?".
pub(super) fn with_suggestion(message: &str) -> String {
    let guess = (|| {
        let rest = message
            .strip_prefix("unknown field `")
            .or_else(|| message.strip_prefix("unknown variant `"))?;
        let (typed, expected) = rest.split_once('`')?;
        let typed = typed.to_ascii_lowercase();
        let best = expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|name| (edit_distance(&typed, &name.to_ascii_lowercase()), name))
            .min()?;
        // Close enough to be a typo: a third of the name, at least two edits.
        (best.0 <= (typed.chars().count() / 3).max(2)).then(|| best.1.to_owned())
    })();
    match guess {
        Some(name) => {
            let (head, tail) = message.split_once(", expected").unwrap_or((message, ""));
            if tail.is_empty() {
                format!("{head} — did you mean `{name}`?")
            } else {
                format!("{head} — did you mean `{name}`? (expected{tail})")
            }
        }
        None => message.to_owned(),
    }
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1)
                .min(row[j] + 1)
                .min(diag + usize::from(ca != *cb));
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}
