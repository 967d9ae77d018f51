//! llguidance behind the `TokenConstraint` trait: a token trie built once per model from our
//! tokenizer's bytes, grammars compiled per request, and the per-step mask with the reasoning
//! block left free.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};

use super::lark::{grammar, OutputSpec};
use super::{MaskStats, TokenConstraint, TokenMask};
use crate::text::{ids, Tokenizer};

/// The bridge from our tokenizer to llguidance: each id's bytes (special tokens behind llguidance's
/// 0xFF marker, so no text grammar can produce them; ids past the tokenizer, the padded logit
/// rows, have none) and our encoder.
struct TokenizerBridge {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// Grammar compilation for one model: the token trie and llguidance's parser factory. Built once
/// (a few hundred ms for the 248K vocabulary); cheap to share.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl Grammars {
    /// `vocab`: logit rows (may exceed the tokenizer's ids).
    pub fn new(tokenizer: &Tokenizer, vocab: usize) -> Result<Self> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Some(bytes) if tokenizer.is_special(id) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                }
                Some(bytes) => bytes.to_vec(),
                None => Vec::new(),
            })
            .collect();
        let mut info = TokRxInfo::new(vocab as u32, ids::IM_END);
        info.tok_end_of_turn = Some(ids::IM_END);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TokenizerBridge {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )?;
        factory.quiet();
        Ok(Grammars { factory, vocab })
    }

    /// Compiles what `spec` asks for; the error says what is wrong with it (a 400 to the client).
    pub fn compile(&self, spec: &OutputSpec) -> Result<Grammar, String> {
        let lark = grammar(spec)?;
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| format!("{e:#}"))?;
        Ok(Grammar {
            parser: Some(parser),
            env: self.factory.tok_env().clone(),
            vocab: self.vocab,
        })
    }

    /// No grammar, only a reasoning budget: `</think>` is forced after `budget` reasoning tokens
    /// (Anthropic's `thinking.budget_tokens`); the answer after it is free.
    pub fn reasoning_budget(&self, budget: usize) -> Box<dyn TokenConstraint> {
        Grammar {
            parser: None,
            env: self.factory.tok_env().clone(),
            vocab: self.vocab,
        }
        .constraint(Reasoning::Open {
            budget: Some(budget),
        })
    }
}

/// A compiled grammar, ready to constrain one generation.
pub struct Grammar {
    /// None: a reasoning budget alone.
    parser: Option<TokenParser>,
    env: TokEnv,
    vocab: usize,
}

/// Where the grammar starts: at once, or after the reasoning block the prompt opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reasoning {
    /// The prompt closed (or never opened) `<think>`: the grammar applies from the first token.
    Closed,
    /// The model is reasoning: free until `</think>`; with a budget, `</think>` is forced once
    /// that many tokens have been spent on reasoning.
    Open { budget: Option<usize> },
}

impl Grammar {
    pub fn constraint(self, reasoning: Reasoning) -> Box<dyn TokenConstraint> {
        let phase = match reasoning {
            Reasoning::Closed => Phase::Grammar,
            Reasoning::Open { budget } => Phase::Reasoning {
                spent: 0,
                budget,
                tail: Vec::new(),
            },
        };
        Box::new(GrammarConstraint {
            matcher: self.parser.map(|p| Matcher::new(Ok(p))),
            env: self.env,
            phase,
            mask: None,
            vocab: self.vocab,
            stats: MaskStats::default(),
            failed: false,
        })
    }
}

const THINK_END: &[u8] = b"</think>";

enum Phase {
    Reasoning {
        spent: usize,
        budget: Option<usize>,
        /// The last bytes generated, to see `</think>` however it was tokenised.
        tail: Vec<u8>,
    },
    Grammar,
}

struct GrammarConstraint {
    /// None: free once the reasoning is over.
    matcher: Option<Matcher>,
    env: TokEnv,
    phase: Phase,
    /// This step's mask, until the token is committed.
    mask: Option<TokenMask>,
    vocab: usize,
    stats: MaskStats,
    /// The grammar hit an error; from then on only end-of-turn is allowed.
    failed: bool,
}

impl GrammarConstraint {
    fn fail(&mut self, what: &str, err: impl std::fmt::Display) {
        if !self.failed {
            tracing::warn!("constrained decoding stopped: {what}: {err}");
        }
        self.failed = true;
    }
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self) -> Option<&TokenMask> {
        if self.mask.is_none() {
            match &self.phase {
                Phase::Reasoning { spent, budget, .. } => {
                    if budget.is_some_and(|b| *spent >= b) {
                        self.mask = Some(TokenMask::only(self.vocab, &[ids::THINK_END]));
                    }
                }
                Phase::Grammar => {
                    let matcher = self.matcher.as_mut()?;
                    let started = Instant::now();
                    let words = if self.failed {
                        None
                    } else {
                        match matcher.compute_mask_or_eos() {
                            Ok(m) => Some(m.as_slice().to_vec()),
                            Err(e) => {
                                self.fail("no mask", e);
                                None
                            }
                        }
                    };
                    let mask = match words {
                        Some(w) => TokenMask::from_words(w, self.vocab),
                        None => TokenMask::only(self.vocab, &[ids::IM_END]),
                    };
                    self.stats.add(started.elapsed());
                    self.mask = Some(mask);
                }
            }
        }
        self.mask.as_ref()
    }

    fn commit(&mut self, token: u32) {
        self.mask = None;
        match &mut self.phase {
            Phase::Reasoning { spent, tail, .. } => {
                *spent += 1;
                if (token as usize) < self.env.tok_trie().vocab_size() {
                    tail.extend_from_slice(self.env.tok_trie().token(token));
                }
                let closed = token == ids::THINK_END
                    || tail.windows(THINK_END.len()).any(|w| w == THINK_END);
                if closed {
                    self.phase = Phase::Grammar;
                } else if tail.len() > THINK_END.len() {
                    tail.drain(..tail.len() - THINK_END.len());
                }
            }
            Phase::Grammar => {
                let Some(matcher) = self.matcher.as_mut() else {
                    return;
                };
                if !self.failed && !matcher.is_stopped() {
                    if let Err(e) = matcher.consume_token(token) {
                        self.fail("token refused", e);
                    }
                }
            }
        }
    }

    fn stats(&self) -> MaskStats {
        self.stats
    }
}
