//! A backend's options declared once. `backend_options!` turns one table (lily-cuda's
//! `CudaOptions`, lily-wgpu's `WgpuOptions`) into the options struct and its `Default`, the rows
//! `SWITCHES`, `KNOBS` and `TEXTS` (lily-server builds each backend's flags from them, with no
//! code per option), and the `Options` accessors by field name through which the functions
//! below read the environment's overrides (`with_overrides`), write the one-line `describe` and
//! the crate README's option rows (`readme_rows`, which a unit test of each crate keeps equal to
//! its README).
//!
//! A row's environment override: a switch's variable set to `1` or `0` sets it (the first of its
//! variables so set decides), a knob's sets it when it is a whole number the knob accepts, a
//! text option's when it parses (`TextValue`); anything else leaves the option as it is.

/// One on/off switch (a row of a `backend_options!` table).
#[derive(Clone, Copy, Debug)]
pub struct Switch {
    /// The options struct's field.
    pub field: &'static str,
    /// The field prefixed with the table's id: unique among every backend's rows (clap's id).
    pub key: &'static str,
    /// The value that ships.
    pub default: bool,
    /// The `lily-engine` flag that sets the other side (`None`: environment only).
    pub flag: Option<&'static str>,
    /// The environment override and the value its `1` gives the field (`0` the other).
    pub env: &'static str,
    pub env_one: bool,
    /// Further variables that set it as `env` does, read after `env`.
    pub also: &'static [&'static str],
    /// `describe`'s label.
    pub label: &'static str,
    /// What the switch does when on.
    pub help: &'static str,
    /// Why it stays (its last A/B, or the fallback its other side is).
    pub why: &'static str,
}

/// One numeric knob (a row of a `backend_options!` table).
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    pub field: &'static str,
    pub key: &'static str,
    pub default: usize,
    /// The `lily-engine` flag that sets it (`None`: environment only).
    pub flag: Option<&'static str>,
    pub env: &'static str,
    /// The values it takes, and their description for errors and docs.
    pub accepts: fn(usize) -> bool,
    pub accepted: &'static str,
    pub label: &'static str,
    pub help: &'static str,
}

/// One option given as text: a name, or one of a few words (a row of a `backend_options!`
/// table; its field's type is a `TextValue`).
#[derive(Clone, Copy, Debug)]
pub struct Text {
    pub field: &'static str,
    pub key: &'static str,
    /// The `lily-engine` flag that sets it (`None`: environment only).
    pub flag: Option<&'static str>,
    pub env: &'static str,
    /// The flag's value name in help (`NAME`).
    pub value_name: &'static str,
    /// The text the flag given alone stands for (`--wgpu-f16-acts` is `--wgpu-f16-acts on`:
    /// a switch's flag turned into a text option keeps working); `None`: the flag takes a value.
    pub alone: Option<&'static str>,
    /// The texts it takes, for errors and docs.
    pub accepted: &'static str,
    pub label: &'static str,
    pub help: &'static str,
}

/// A text option's type: how a flag's or variable's text sets it, and how it is shown.
pub trait TextValue: Sized {
    fn parse_text(text: &str) -> Option<Self>;
    fn show_text(&self) -> String;
}

/// A name that may be unset (shown as `any`).
impl TextValue for Option<String> {
    fn parse_text(text: &str) -> Option<Self> {
        Some(Some(text.to_string()))
    }

    fn show_text(&self) -> String {
        self.as_deref().unwrap_or("any").to_string()
    }
}

/// A backend's options as `backend_options!` declares them.
pub trait Options: Default + Clone + 'static {
    /// The help heading of the backend's flags.
    const HEADING: &'static str;
    const SWITCHES: &'static [Switch];
    const KNOBS: &'static [Knob];
    const TEXTS: &'static [Text];
    /// The switch named `field` (a `SWITCHES` row's field).
    fn switch(&self, field: &str) -> Option<bool>;
    fn switch_mut(&mut self, field: &str) -> Option<&mut bool>;
    /// The knob named `field` (a `KNOBS` row's field).
    fn knob(&self, field: &str) -> Option<usize>;
    fn knob_mut(&mut self, field: &str) -> Option<&mut usize>;
    /// The text option named `field` (a `TEXTS` row's field), shown.
    fn text(&self, field: &str) -> Option<String>;
    /// Sets the text option named `field` from `text`; false where it does not parse.
    fn set_text(&mut self, field: &str, text: &str) -> bool;
}

impl Switch {
    /// The environment value that sets the switch to `on`.
    pub fn env_value(&self, on: bool) -> &'static str {
        if on == self.env_one {
            "1"
        } else {
            "0"
        }
    }

    /// The flag's help: what the switch does, which side the flag sets, its variable.
    pub fn flag_help(&self) -> String {
        let side = if self.default { "off" } else { "on" };
        format!(
            "Turns {side}: {} [env {}={}]",
            self.help,
            self.env,
            self.env_value(!self.default)
        )
    }
}

impl Knob {
    pub fn flag_help(&self) -> String {
        format!(
            "{} ({}) [default: {}; env {}]",
            self.help, self.accepted, self.default, self.env
        )
    }
}

impl Text {
    /// The flag's help, with the value `default` shows as.
    pub fn flag_help(&self, default: &str) -> String {
        let alone = self
            .alone
            .map(|a| format!("; the flag alone: {a}"))
            .unwrap_or_default();
        format!(
            "{} ({}{alone}) [default: {default}; env {}]",
            self.help, self.accepted, self.env
        )
    }
}

/// `o` with the overrides of the variables looked up by `var` on top (see the module comment).
pub fn with_overrides<O: Options>(mut o: O, var: impl Fn(&str) -> Option<String>) -> O {
    for s in O::SWITCHES {
        let value = std::iter::once(s.env)
            .chain(s.also.iter().copied())
            .find_map(|k| match var(k).as_deref() {
                Some("1") => Some(s.env_one),
                Some("0") => Some(!s.env_one),
                _ => None,
            });
        if let (Some(value), Some(field)) = (value, o.switch_mut(s.field)) {
            *field = value;
        }
    }
    for k in O::KNOBS {
        let Some(n) = var(k.env).and_then(|v| v.parse::<usize>().ok()) else {
            continue;
        };
        if let Some(field) = o.knob_mut(k.field).filter(|_| (k.accepts)(n)) {
            *field = n;
        }
    }
    for t in O::TEXTS {
        if let Some(text) = var(t.env) {
            o.set_text(t.field, &text);
        }
    }
    o
}

/// One line: every switch (`label on|off`), knob (`label N`) and text option (`label text`), in
/// table order.
/// The checks every backend's table must pass (its unit tests call this): each row names a field
/// holding the row's default, every variable starts `LILY_`, every switch says what it does and
/// why it stays, every knob accepts its default, every text option shows as a text it takes, and
/// no flag or variable is declared twice. Returns the flags and variables, for further checks.
pub fn check_table<O: Options>() -> Vec<&'static str> {
    let o = O::default();
    let mut names: Vec<&'static str> = Vec::new();
    for s in O::SWITCHES {
        assert_eq!(o.switch(s.field), Some(s.default), "{}", s.field);
        assert!(s.env.starts_with("LILY_") && !s.help.is_empty() && !s.why.is_empty());
        names.extend(s.flag);
        names.push(s.env);
        names.extend(s.also);
    }
    for k in O::KNOBS {
        assert_eq!(o.knob(k.field), Some(k.default), "{}", k.field);
        assert!((k.accepts)(k.default), "{}", k.field);
        names.extend(k.flag);
        names.push(k.env);
    }
    for t in O::TEXTS {
        let shown = o.text(t.field).unwrap_or_default();
        let mut again = O::default();
        assert!(again.set_text(t.field, &shown), "{}", t.field);
        if let Some(alone) = t.alone {
            assert!(again.set_text(t.field, alone), "{}", t.field);
        }
        names.extend(t.flag);
        names.push(t.env);
    }
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(
        unique.len(),
        names.len(),
        "a flag or variable is declared twice"
    );
    names
}

/// An environment made of `pairs` (name, value), for tests of [`with_overrides`].
pub fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

pub fn describe<O: Options>(o: &O) -> String {
    let switches = O::SWITCHES.iter().map(|s| {
        let on = o.switch(s.field).unwrap_or(s.default);
        format!("{} {}", s.label, if on { "on" } else { "off" })
    });
    let knobs = O::KNOBS
        .iter()
        .map(|k| format!("{} {}", k.label, o.knob(k.field).unwrap_or(k.default)));
    let texts = O::TEXTS
        .iter()
        .map(|t| format!("{} {}", t.label, o.text(t.field).unwrap_or_default()));
    switches
        .chain(knobs)
        .chain(texts)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The crate README's table of options (the README holds exactly these rows; a unit test of
/// each crate checks it).
pub fn readme_rows<O: Options>() -> String {
    let mut out = String::from(
        "| flag | environment (on / off) | default | what it does when on |\n|---|---|---|---|\n",
    );
    for s in O::SWITCHES {
        let flag = s.flag.map_or("—".to_string(), |f| format!("`--{f}`"));
        let on = if s.default { "on" } else { "off" };
        let also: String = s.also.iter().map(|v| format!(" (or `{v}`)")).collect();
        out += &format!(
            "| {flag} | `{}={}` / `{}`{also} | {on} | {} |\n",
            s.env,
            s.env_value(true),
            s.env_value(false),
            s.help
        );
    }
    for k in O::KNOBS {
        let flag = k.flag.map_or("—".to_string(), |f| format!("`--{f} N`"));
        out += &format!(
            "| {flag} | `{}=N` ({}) | {} | {} |\n",
            k.env, k.accepted, k.default, k.help
        );
    }
    let defaults = O::default();
    for t in O::TEXTS {
        let flag = match (t.flag, t.alone) {
            (None, _) => "—".to_string(),
            (Some(f), None) => format!("`--{f} {}`", t.value_name),
            (Some(f), Some(alone)) => format!("`--{f} [{}]` (alone: `{alone}`)", t.value_name),
        };
        out += &format!(
            "| {flag} | `{}={}` ({}) | {} | {} |\n",
            t.env,
            t.value_name,
            t.accepted,
            defaults.text(t.field).unwrap_or_default(),
            t.help
        );
    }
    out
}

/// Declares a backend's options once: the struct (`$name`), its `Default`, the module's
/// `SWITCHES`, `KNOBS` and `TEXTS`, the `Options` impl and the inherent `with_env_overrides`,
/// `with_overrides` and `describe`. `fields` are options set by code only (no flag, no
/// variable), declared here so the struct stays in one place.
#[macro_export]
macro_rules! backend_options {
    (
        $(#[$meta:meta])*
        pub struct $name:ident, heading $heading:literal, id $id:literal;
        switches {
            $( $sf:ident = $sd:literal, flag $sflag:expr, env $senv:literal $(| $salso:literal)* = $sone:literal,
               label $slabel:literal, help $shelp:literal, why $swhy:literal; )*
        }
        knobs {
            $( $kf:ident = $kd:expr, flag $kflag:expr, env $kenv:literal,
               accepts $kacc:expr, $kaccepted:literal, label $klabel:literal, help $khelp:literal; )*
        }
        texts {
            $( $tf:ident: $tt:ty = $td:expr, flag $tflag:expr, env $tenv:literal, value $tvalue:literal,
               $(alone $talone:literal,)? accepts $taccepted:literal, label $tlabel:literal, help $thelp:literal; )*
        }
        fields {
            $( $(#[$fmeta:meta])* $ff:ident: $ft:ty = $fd:expr; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $name {
            $( #[doc = $shelp] pub $sf: bool, )*
            $( #[doc = $khelp] pub $kf: usize, )*
            $( #[doc = $thelp] pub $tf: $tt, )*
            $( $(#[$fmeta])* pub $ff: $ft, )*
        }

        impl Default for $name {
            fn default() -> $name {
                $name {
                    $( $sf: $sd, )*
                    $( $kf: $kd, )*
                    $( $tf: $td, )*
                    $( $ff: $fd, )*
                }
            }
        }

        /// Every switch, in `describe` order.
        pub const SWITCHES: &[$crate::options::Switch] = &[
            $( $crate::options::Switch {
                field: stringify!($sf),
                key: concat!($id, "-", stringify!($sf)),
                default: $sd,
                flag: $sflag,
                env: $senv,
                env_one: $sone,
                also: &[$($salso),*],
                label: $slabel,
                help: $shelp,
                why: $swhy,
            }, )*
        ];

        /// Every numeric knob, in `describe` order.
        pub const KNOBS: &[$crate::options::Knob] = &[
            $( $crate::options::Knob {
                field: stringify!($kf),
                key: concat!($id, "-", stringify!($kf)),
                default: $kd,
                flag: $kflag,
                env: $kenv,
                accepts: $kacc,
                accepted: $kaccepted,
                label: $klabel,
                help: $khelp,
            }, )*
        ];

        /// Every text option, in `describe` order.
        pub const TEXTS: &[$crate::options::Text] = &[
            $( $crate::options::Text {
                field: stringify!($tf),
                key: concat!($id, "-", stringify!($tf)),
                flag: $tflag,
                env: $tenv,
                value_name: $tvalue,
                alone: {
                    let alone: Option<&'static str> = None;
                    $( let alone = Some($talone); )?
                    alone
                },
                accepted: $taccepted,
                label: $tlabel,
                help: $thelp,
            }, )*
        ];

        impl $crate::options::Options for $name {
            const HEADING: &'static str = $heading;
            const SWITCHES: &'static [$crate::options::Switch] = SWITCHES;
            const KNOBS: &'static [$crate::options::Knob] = KNOBS;
            const TEXTS: &'static [$crate::options::Text] = TEXTS;

            fn switch(&self, field: &str) -> Option<bool> {
                match field {
                    $( stringify!($sf) => Some(self.$sf), )*
                    _ => None,
                }
            }

            fn switch_mut(&mut self, field: &str) -> Option<&mut bool> {
                match field {
                    $( stringify!($sf) => Some(&mut self.$sf), )*
                    _ => None,
                }
            }

            fn knob(&self, field: &str) -> Option<usize> {
                match field {
                    $( stringify!($kf) => Some(self.$kf), )*
                    _ => None,
                }
            }

            fn knob_mut(&mut self, field: &str) -> Option<&mut usize> {
                match field {
                    $( stringify!($kf) => Some(&mut self.$kf), )*
                    _ => None,
                }
            }

            fn text(&self, field: &str) -> Option<String> {
                match field {
                    $( stringify!($tf) => Some($crate::options::TextValue::show_text(&self.$tf)), )*
                    _ => None,
                }
            }

            fn set_text(&mut self, field: &str, text: &str) -> bool {
                match field {
                    $( stringify!($tf) => match <$tt as $crate::options::TextValue>::parse_text(text) {
                        Some(v) => {
                            self.$tf = v;
                            true
                        }
                        None => false,
                    }, )*
                    _ => {
                        let _ = text;
                        false
                    }
                }
            }
        }

        impl $name {
            /// These options with the environment overrides on top: the one place the backend
            /// reads its `LILY_*` variables (`lily_core::options`).
            pub fn with_env_overrides(self) -> $name {
                self.with_overrides(|k| std::env::var(k).ok())
            }

            /// `with_env_overrides` with the variables looked up by `var` (tests).
            pub fn with_overrides(self, var: impl Fn(&str) -> Option<String>) -> $name {
                $crate::options::with_overrides(self, var)
            }

            /// One line: every option, in table order (`lily_core::options::describe`).
            pub fn describe(&self) -> String {
                $crate::options::describe(self)
            }
        }
    };
}
