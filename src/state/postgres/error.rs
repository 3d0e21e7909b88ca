//! PostgreSQL's errors in words, for logs and the answers' reasons.

/// A database error in words: tokio-postgres displays a server's error as
/// just "db error"; its message and SQLSTATE are what an operator needs.
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}
