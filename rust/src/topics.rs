//! Topic names, topic filters and the two topic trees of the broker: the subscription index
//! (filter -> subscribers, looked up by topic) and the retained-message tree (topic -> value,
//! looked up by filter). Pure data structures: no I/O, no MQTT session logic.

use crate::codec::QoS;
use std::hash::Hash;

/// Options a subscriber gave for one filter (MQTT 5 subscription options; 3.1.1 uses only qos).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubOpts {
    /// Granted QoS.
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    pub retain_handling: u8,
    /// Subscription identifier, 0 = none (valid identifiers are 1..268,435,455).
    pub identifier: u32,
}

/// A valid PUBLISH topic name: non-empty, no `+` or `#`, no U+0000 (UTF-8 already checked).
pub fn valid_topic_name(topic: &[u8]) -> bool {
    let _ = topic;
    todo!("topics helper")
}

/// A valid topic filter: non-empty; `+` only as a whole level; `#` only as the whole last
/// level; no U+0000. For `$share/{group}/{filter}` the group is non-empty without `+ # /` and
/// the inner filter is valid.
pub fn valid_filter(filter: &str) -> bool {
    let _ = filter;
    todo!("topics helper")
}

/// Splits `$share/{group}/{filter}` into (group, filter); None for a non-shared filter.
pub fn split_shared(filter: &str) -> Option<(&str, &str)> {
    let _ = filter;
    todo!("topics helper")
}

/// Whether `filter` (valid, not shared) matches `topic` (valid), with `+`, `#` and the rule
/// that a filter starting with a wildcard does not match a topic starting with `$`.
pub fn matches(filter: &str, topic: &[u8]) -> bool {
    let _ = (filter, topic);
    todo!("topics helper")
}

/// The subscription index: a trie over filter levels with `+` and `#` children, holding for
/// each filter its subscribers `K` (the engine uses a small integer session id) and options,
/// and for shared filters (`$share/g/f`) the members of each group.
pub struct SubscriptionIndex<K> {
    _k: std::marker::PhantomData<K>,
}

/// One shared-subscription group that matched: the engine picks one member to deliver to.
pub struct SharedMatch<'a, K> {
    /// Members in insertion order.
    pub members: &'a [(K, SubOpts)],
    /// A per-group counter the engine may use for round-robin choice.
    pub cursor: &'a std::cell::Cell<u32>,
}

impl<K: Copy + Eq + Hash> Default for SubscriptionIndex<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Eq + Hash> SubscriptionIndex<K> {
    pub fn new() -> Self {
        todo!("topics helper")
    }

    /// Adds or replaces `key`'s subscription to `filter` (which may be `$share/g/f`).
    /// Returns true if it is new, false if it replaced an existing one (options updated).
    pub fn insert(&mut self, filter: &str, key: K, opts: SubOpts) -> bool {
        let _ = (filter, key, opts);
        todo!("topics helper")
    }

    /// Removes `key`'s subscription to `filter`; returns whether it existed. Empty trie
    /// nodes are pruned so the index does not grow with churn.
    pub fn remove(&mut self, filter: &str, key: K) -> bool {
        let _ = (filter, key);
        todo!("topics helper")
    }

    /// Appends every non-shared subscription matching `topic` to `plain` (a key appears once
    /// per matching filter, so a key with overlapping filters appears several times) and
    /// every matching shared group to `shared`. Allocates nothing beyond growing the vectors.
    pub fn lookup<'a>(
        &'a self,
        topic: &[u8],
        plain: &mut Vec<(K, SubOpts)>,
        shared: &mut Vec<SharedMatch<'a, K>>,
    ) {
        let _ = (topic, plain, shared);
        todo!("topics helper")
    }

    /// Number of (filter, key) subscriptions held, shared ones included.
    pub fn len(&self) -> usize {
        todo!("topics helper")
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Retained messages by topic, looked up by filter (for sending retained messages on
/// SUBSCRIBE): a trie over topic levels so a wildcard lookup visits only matching branches.
pub struct RetainedTree<V> {
    _v: std::marker::PhantomData<V>,
}

impl<V> Default for RetainedTree<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> RetainedTree<V> {
    pub fn new() -> Self {
        todo!("topics helper")
    }

    /// Sets the value for `topic`, returning the old one.
    pub fn insert(&mut self, topic: &[u8], value: V) -> Option<V> {
        let _ = (topic, value);
        todo!("topics helper")
    }

    /// Removes `topic`'s value (pruning empty nodes).
    pub fn remove(&mut self, topic: &[u8]) -> Option<V> {
        let _ = topic;
        todo!("topics helper")
    }

    pub fn get(&self, topic: &[u8]) -> Option<&V> {
        let _ = topic;
        todo!("topics helper")
    }

    /// Calls `f` for every value whose topic matches `filter` (valid, not shared), honouring
    /// the `$` rule.
    pub fn for_each_match(&self, filter: &str, f: impl FnMut(&V)) {
        let _ = (filter, f);
        todo!("topics helper")
    }

    /// Removes every value for which `keep` returns false (used to drop expired messages).
    pub fn retain(&mut self, keep: impl FnMut(&V) -> bool) {
        let _ = keep;
        todo!("topics helper")
    }

    pub fn len(&self) -> usize {
        todo!("topics helper")
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
