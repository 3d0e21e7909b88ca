//! Markup that is safe to send (issue 40, item 5). An [`Html`] is built only
//! from the program's own literals ([`Html::raw_static`], the template of
//! `html!`) and from text escaped by [`esc`]; the page's render functions
//! take and return it. A `String` or `&str` from outside — a lease or holder
//! name, a key, a path, an error — has no way into it but `esc`: forgetting
//! `esc` does not compile.

use std::fmt;

/// Markup that is safe to send: the program's literals and escaped text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Html(String);

/// HTML-escapes text for element content and quoted attributes: the one way
/// from text to [`Html`].
pub fn esc(text: &str) -> Html {
    let mut out = Html::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.0.push_str("&amp;"),
            '<' => out.0.push_str("&lt;"),
            '>' => out.0.push_str("&gt;"),
            '"' => out.0.push_str("&quot;"),
            '\'' => out.0.push_str("&#39;"),
            c => out.0.push(c),
        }
    }
    out
}

impl Html {
    /// No markup.
    pub const fn new() -> Html {
        Html(String::new())
    }

    /// No markup yet, with room for `bytes`.
    pub fn with_capacity(bytes: usize) -> Html {
        Html(String::with_capacity(bytes))
    }

    /// Markup the program spells out: a literal (or a string built once and
    /// kept for the process, such as the page's script).
    pub fn raw_static(markup: &'static str) -> Html {
        Html(markup.to_owned())
    }

    /// Appends markup.
    pub fn push(&mut self, markup: &Html) {
        self.0.push_str(&markup.0);
    }

    /// Appends markup the program spells out.
    pub fn push_static(&mut self, markup: &'static str) {
        self.0.push_str(markup);
    }

    /// `parts` with `separator` between them.
    pub fn join(parts: impl IntoIterator<Item = Html>, separator: &'static str) -> Html {
        let mut out = Html::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                out.0.push_str(separator);
            }
            out.0.push_str(&part.0);
        }
        out
    }

    /// Whether there is no markup.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The markup as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The markup as text, to send.
    pub fn into_string(self) -> String {
        self.0
    }

    /// For `html!` only, which checks the template's arguments: called by
    /// hand it would take any text.
    #[doc(hidden)]
    pub fn push_template(&mut self, template: fmt::Arguments<'_>) {
        use fmt::Write as _;
        let _ = self.0.write_fmt(template);
    }
}

impl fmt::Display for Html {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// What an `html!` template may hold: [`Html`], and numbers (whose digits
/// need no escaping). Sealed: nothing else can be one.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not markup",
    label = "text goes into the page through `esc()`",
    note = "an `html!` argument is `Html` (from `esc`, `Html::raw_static` or `html!`) or a number"
)]
pub trait Markup: fmt::Display + sealed::Sealed {}

impl sealed::Sealed for Html {}
impl Markup for Html {}
impl<T: Markup + ?Sized> sealed::Sealed for &T {}
impl<T: Markup + ?Sized> Markup for &T {}

macro_rules! numbers_are_markup {
    ($($t:ty)*) => {
        $(
            impl sealed::Sealed for $t {}
            impl Markup for $t {}
        )*
    };
}
numbers_are_markup!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

/// For `html!`: an argument, checked to be [`Markup`].
#[doc(hidden)]
pub fn markup<T: Markup + ?Sized>(argument: &T) -> &T {
    argument
}

/// Markup from a template: `html!("<td>{}</td>", esc(name))` is a new
/// [`Html`]; `html!(out, "<td>{}</td>", n)` appends to `out`. The template is
/// a string literal of markup, formatted as by `format!` (`{}`, `{:+}`, `{0}`,
/// `{{`), whose every argument is [`Markup`]: `Html` or a number, so text
/// needs [`esc`]. It cannot capture variables (`{name}` does not compile: the
/// template reaches `format_args!` through `concat!`).
macro_rules! html {
    ($template:literal $(, $argument:expr)* $(,)?) => {{
        let mut out = $crate::admin::markup::Html::new();
        $crate::admin::markup::html!(out, $template $(, $argument)*);
        out
    }};
    ($out:expr, $template:literal $(, $argument:expr)* $(,)?) => {
        $out.push_template(::std::format_args!(
            ::std::concat!($template)
            $(, $crate::admin::markup::markup(&$argument))*
        ))
    };
}
pub(crate) use html;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc(r#"<script>"a'&b"#).as_str(),
            "&lt;script&gt;&quot;a&#39;&amp;b"
        );
    }

    #[test]
    fn templates_take_markup_and_numbers() {
        let name = "<b>";
        let mut out = html!(r#"<td title="{}">{:+} {{}}</td>"#, esc(name), -3i64);
        html!(out, "{0}|{0}|{1}", Html::raw_static("<i>"), 7u8);
        out.push(&Html::join([esc("a/b"), esc("c")], "/<wbr>"));
        assert_eq!(
            out.into_string(),
            r#"<td title="&lt;b&gt;">-3 {}</td><i>|<i>|7a/b/<wbr>c"#
        );
    }
}
