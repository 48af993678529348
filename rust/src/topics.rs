//! Topic names, topic filters and the two topic trees of the broker: the subscription index
//! (filter -> subscribers, looked up by topic) and the retained-message tree (topic -> value,
//! looked up by filter). Pure data structures: no I/O, no MQTT session logic.
//!
//! Costs (L = levels of the topic or filter, G = members of one shared group):
//! - `SubscriptionIndex::lookup`: O(matching trie nodes + output): one hash probe per
//!   literal level visited, no allocation besides growing the output vectors.
//! - `SubscriptionIndex::insert`: O(L) expected, however many keys already share the filter
//!   (a node's subscriber list gets a key -> position map past a threshold).
//! - `SubscriptionIndex::remove`: O(L) expected; O(L + G) for a shared subscription, whose
//!   group keeps its members in insertion order.
//! - `RetainedTree`: insert/get/remove O(L); `for_each_match` O(visited nodes); `retain` O(n).
//!
//! Nothing recurses deeper than a small constant, so a hostile 32k-level topic or filter
//! (65535 bytes of `/`) cannot overflow the stack on lookup, removal or drop.

use crate::codec::QoS;
use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

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

/// Longest topic name or filter: it is a UTF-8 string field with a 16-bit length.
const MAX_LEN: usize = 65_535;

const SHARE_PREFIX: &str = "$share/";

// ---------------------------------------------------------------------------------------------
// Hashing

/// A small multiplicative hasher in the spirit of FxHash, but with a folded multiply (the high
/// and low halves of the 128-bit product xored, as in foldhash) instead of Fx's plain one:
/// trie keys are short level names and small session ids, for which SipHash's setup cost
/// dominates, but a plain multiply only carries entropy upwards, so names differing in
/// their last byte ("room1", "room2") collided in the bits hashbrown probes with. Not
/// DoS-resistant: a client crafting colliding level names can only slow down the nodes it
/// subscribes or retains under.
#[derive(Clone, Copy)]
struct FoldHasher {
    hash: u64,
}

impl Default for FoldHasher {
    fn default() -> Self {
        // Non-zero, so that the zero key does not hash to the zero state.
        FoldHasher {
            hash: 0x243f_6a88_85a3_08d3,
        }
    }
}

const FOLD_MUL: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FoldHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        let product = u128::from(self.hash ^ word) * u128::from(FOLD_MUL);
        self.hash = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, mut bytes: &[u8]) {
        while let Some((chunk, rest)) = bytes.split_first_chunk::<8>() {
            self.add(u64::from_le_bytes(*chunk));
            bytes = rest;
        }
        // The 0..7 byte tail as one word without a memcpy call, from overlapping loads. Tails
        // of one length map to distinct words, and `[u8]`'s Hash writes the length first.
        let n = bytes.len();
        if n >= 4 {
            let lo = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
            let hi = u32::from_le_bytes(bytes[n - 4..].try_into().expect("4 bytes"));
            self.add(u64::from(lo) | u64::from(hi) << 32);
        } else if n > 0 {
            let w =
                u64::from(bytes[0]) | u64::from(bytes[n / 2]) << 8 | u64::from(bytes[n - 1]) << 16;
            self.add(w);
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i.into());
    }
    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(i.into());
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i.into());
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

/// Bytes of a level name kept inline in a `LevelKey`.
const INLINE_LEVEL: usize = 30;

/// A level name as a trie map key. Short names (most MQTT levels) are stored inline so a
/// probe compares them without chasing a pointer to another cache line, and a node costs no
/// extra allocation; measured ~40% faster probes than `Box<[u8]>` on large fan-out nodes.
#[derive(Clone)]
enum LevelKey {
    Inline { len: u8, bytes: [u8; INLINE_LEVEL] },
    Heap(Box<[u8]>),
}

impl LevelKey {
    fn new(level: &[u8]) -> Self {
        if level.len() <= INLINE_LEVEL {
            let mut bytes = [0; INLINE_LEVEL];
            bytes[..level.len()].copy_from_slice(level);
            LevelKey::Inline {
                len: level.len() as u8,
                bytes,
            }
        } else {
            LevelKey::Heap(level.into())
        }
    }

    #[inline]
    fn as_bytes(&self) -> &[u8] {
        match self {
            LevelKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            LevelKey::Heap(b) => b,
        }
    }
}

impl Default for LevelKey {
    fn default() -> Self {
        LevelKey::new(b"")
    }
}

// Borrow<[u8]> lets maps be probed with a topic's level slice; Hash and Eq therefore
// delegate to the slice so both sides hash identically.
impl std::borrow::Borrow<[u8]> for LevelKey {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl Hash for LevelKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl PartialEq for LevelKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for LevelKey {}

// ---------------------------------------------------------------------------------------------
// Validation and matching

/// A valid PUBLISH topic name: non-empty, no `+` or `#`, no U+0000 (UTF-8 already checked).
pub fn valid_topic_name(topic: &[u8]) -> bool {
    !topic.is_empty()
        && topic.len() <= MAX_LEN
        && !topic.iter().any(|&b| matches!(b, b'+' | b'#' | 0))
}

/// A valid topic filter: non-empty; `+` only as a whole level; `#` only as the whole last
/// level; no U+0000. For `$share/{group}/{filter}` the group is non-empty without `+ # /` and
/// the inner filter is valid.
pub fn valid_filter(filter: &str) -> bool {
    if filter.len() > MAX_LEN {
        return false;
    }
    match filter.strip_prefix(SHARE_PREFIX) {
        // Anything under `$share/` is a shared subscription, so it must have both parts.
        Some(rest) => match rest.split_once('/') {
            Some((group, inner)) => {
                !group.is_empty()
                    && !group.bytes().any(|b| matches!(b, b'+' | b'#' | 0))
                    && valid_plain_filter(inner.as_bytes())
            }
            None => false,
        },
        None => valid_plain_filter(filter.as_bytes()),
    }
}

/// Filter validity without the `$share/` syntax, in one pass over the bytes.
fn valid_plain_filter(f: &[u8]) -> bool {
    if f.is_empty() {
        return false;
    }
    let last = f.len() - 1;
    f.iter().enumerate().all(|(i, &b)| {
        let level_start = i == 0 || f[i - 1] == b'/';
        let level_end = i == last || f[i + 1] == b'/';
        match b {
            b'+' => level_start && level_end,
            b'#' => level_start && i == last,
            0 => false,
            _ => true,
        }
    })
}

/// Splits `$share/{group}/{filter}` into (group, filter); None for a non-shared filter (and
/// for a `$share/...` string without the second `/`, which `valid_filter` rejects anyway).
pub fn split_shared(filter: &str) -> Option<(&str, &str)> {
    filter.strip_prefix(SHARE_PREFIX)?.split_once('/')
}

/// Whether `filter` (valid, not shared) matches `topic` (valid), with `+`, `#` and the rule
/// that a filter starting with a wildcard does not match a topic starting with `$`.
pub fn matches(filter: &str, topic: &[u8]) -> bool {
    let f = filter.as_bytes();
    if topic.first() == Some(&b'$') && matches!(f.first(), Some(b'+' | b'#')) {
        return false;
    }
    let mut fl = f.split(|&b| b == b'/');
    let mut tl = topic.split(|&b| b == b'/');
    loop {
        match (fl.next(), tl.next()) {
            // `#` also matches the parent level: "sport/#" matches "sport".
            (Some([b'#']), _) => return true,
            (Some([b'+']), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The level starting at byte `pos` of `s`, and where the next level starts (None: it was
/// the last level).
#[inline]
fn level_at(s: &[u8], pos: usize) -> (&[u8], Option<usize>) {
    let rest = &s[pos..];
    match rest.iter().position(|&b| b == b'/') {
        Some(i) => (&rest[..i], Some(pos + i + 1)),
        None => (rest, None),
    }
}

/// The trie path of a (non-shared) filter: its levels without a trailing `#`, and whether
/// it had one. `#` subscribers live in a dedicated slot of the parent level's node, so
/// "a/#" is stored on node "a" and a lookup reaching "a" (topic "a" or deeper) finds them.
fn filter_path(f: &str) -> (Levels<'_>, bool) {
    if f == "#" {
        (Levels { rest: None }, true)
    } else if let Some(parent) = f.strip_suffix("/#") {
        (Levels { rest: Some(parent) }, true)
    } else {
        (Levels { rest: Some(f) }, false)
    }
}

/// Like `str::split('/')`, but able to yield nothing (the path of "#" is empty).
#[derive(Clone)]
struct Levels<'a> {
    rest: Option<&'a str>,
}

impl<'a> Iterator for Levels<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        let s = self.rest?;
        match s.split_once('/') {
            Some((level, rest)) => {
                self.rest = Some(rest);
                Some(level)
            }
            None => {
                self.rest = None;
                Some(s)
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Subscription index

/// A linear scan beats hashing for a few entries; past this many subscribers of one filter
/// (or members of one group) a key -> position map keeps insert and remove O(1).
const INDEX_ABOVE: usize = 32;
/// Drop the map again below this (hysteresis, so churn around the threshold is cheap).
const INDEX_BELOW: usize = INDEX_ABOVE / 2;

/// Subscribers of one filter (or members of one shared group).
struct SubList<K> {
    list: Vec<(K, SubOpts)>,
    /// Position of each key in `list`, only while the list is long.
    index: Option<Box<FastMap<K, u32>>>,
}

impl<K: Copy + Eq + Hash> SubList<K> {
    fn new() -> Self {
        SubList {
            list: Vec::new(),
            index: None,
        }
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Inserts or updates; true if `key` was not there.
    fn upsert(&mut self, key: K, opts: SubOpts) -> bool {
        let found = match &self.index {
            Some(ix) => ix.get(&key).map(|&i| i as usize),
            None => self.list.iter().position(|e| e.0 == key),
        };
        if let Some(i) = found {
            self.list[i].1 = opts;
            return false;
        }
        self.list.push((key, opts));
        match &mut self.index {
            Some(ix) => {
                ix.insert(key, (self.list.len() - 1) as u32);
            }
            None if self.list.len() > INDEX_ABOVE => {
                let ix = self.list.iter().enumerate().map(|(i, e)| (e.0, i as u32));
                self.index = Some(Box::new(ix.collect()));
            }
            None => {}
        }
        true
    }

    /// Removes `key`; `keep_order` keeps the others in insertion order (shared groups
    /// promise it), otherwise the last entry fills the hole in O(1).
    fn remove(&mut self, key: K, keep_order: bool) -> bool {
        let pos = match &mut self.index {
            Some(ix) => ix.remove(&key).map(|i| i as usize),
            None => self.list.iter().position(|e| e.0 == key),
        };
        let Some(pos) = pos else { return false };
        if keep_order {
            self.list.remove(pos);
            if let Some(ix) = &mut self.index {
                for (i, e) in self.list.iter().enumerate().skip(pos) {
                    ix.insert(e.0, i as u32);
                }
            }
        } else {
            self.list.swap_remove(pos);
            if let (Some(ix), Some(moved)) = (&mut self.index, self.list.get(pos)) {
                ix.insert(moved.0, pos as u32);
            }
        }
        if self.list.len() < INDEX_BELOW {
            self.index = None;
        }
        // Give memory back after a mass unsubscribe from a popular filter.
        if self.list.capacity() > 64 && self.list.len() < self.list.capacity() / 4 {
            self.list.shrink_to(self.list.len() * 2);
        }
        true
    }
}

/// One `$share/{name}/{filter}` group on the node of `filter`.
struct SharedGroup<K> {
    /// The whole subscription, `$share/{group}/{filter}`: what names the group cluster-wide.
    key: Box<str>,
    members: SubList<K>,
    cursor: Cell<u32>,
}

/// Everything subscribed to one exact filter.
struct Slot<K> {
    plain: SubList<K>,
    /// Few groups per filter in practice, so a Vec searched by name.
    shared: Vec<SharedGroup<K>>,
}

impl<K: Copy + Eq + Hash> Slot<K> {
    fn new() -> Self {
        Slot {
            plain: SubList::new(),
            shared: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.plain.is_empty() && self.shared.is_empty()
    }

    #[inline]
    fn emit<'a>(&'a self, plain: &mut Vec<(K, SubOpts)>, shared: &mut Vec<SharedMatch<'a, K>>) {
        plain.extend_from_slice(&self.plain.list);
        shared.extend(self.shared.iter().map(|g| SharedMatch {
            key: &g.key,
            members: &g.members.list,
            cursor: &g.cursor,
        }));
    }
}

/// A trie node: one filter level.
struct Node<K> {
    /// Subscriptions whose filter ends at this level.
    subs: Slot<K>,
    /// Subscriptions whose filter is this level followed by `/#` (a leaf: `#` is last).
    hash: Option<Box<Slot<K>>>,
    /// Child for a `+` level.
    plus: Option<Box<Node<K>>>,
    /// Children by literal level name; bytes so a topic level looks up without a UTF-8 check.
    literal: FastMap<LevelKey, Node<K>>,
}

impl<K> Drop for Node<K> {
    /// Dropping children through an explicit stack instead of the default recursion, so a
    /// 32k-level filter chain cannot overflow the stack when it is pruned or the index dies.
    fn drop(&mut self) {
        if self.literal.is_empty() && self.plus.is_none() {
            return;
        }
        let mut stack = Vec::new();
        self.take_children(&mut stack);
        while let Some(mut node) = stack.pop() {
            node.take_children(&mut stack);
            // `node` now has no children, so its own drop ends at once.
        }
    }
}

impl<K> Node<K> {
    fn take_children(&mut self, into: &mut Vec<Node<K>>) {
        into.extend(std::mem::take(&mut self.literal).into_values());
        if let Some(plus) = self.plus.take() {
            into.push(*plus);
        }
    }
}

/// Lookup recurses into `+` branches (cheapest for normal topics) up to this depth, then
/// continues with a heap stack so a hostile `+/+/+/...` filter cannot exhaust the stack.
const RECURSION_LIMIT: usize = 48;

impl<K: Copy + Eq + Hash> Node<K> {
    fn new() -> Self {
        Node {
            subs: Slot::new(),
            hash: None,
            plus: None,
            literal: FastMap::default(),
        }
    }

    fn child_count(&self) -> usize {
        self.literal.len() + usize::from(self.plus.is_some())
    }

    fn is_empty(&self) -> bool {
        self.subs.is_empty() && self.hash.is_none() && self.child_count() == 0
    }

    fn child(&self, level: &str) -> Option<&Node<K>> {
        if level == "+" {
            self.plus.as_deref()
        } else {
            self.literal.get(level.as_bytes())
        }
    }

    fn child_mut(&mut self, level: &str) -> Option<&mut Node<K>> {
        if level == "+" {
            self.plus.as_deref_mut()
        } else {
            self.literal.get_mut(level.as_bytes())
        }
    }

    fn child_or_insert(&mut self, level: &str) -> &mut Node<K> {
        if level == "+" {
            return self.plus.get_or_insert_with(|| Box::new(Node::new()));
        }
        let key = level.as_bytes();
        // Probing twice avoids building the key when the child exists (the common case:
        // many subscribers share filter prefixes).
        if !self.literal.contains_key(key) {
            self.literal.insert(LevelKey::new(key), Node::new());
        }
        self.literal.get_mut(key).expect("child was just inserted")
    }

    fn detach_child(&mut self, level: &str) {
        if level == "+" {
            self.plus = None;
        } else {
            self.literal.remove(level.as_bytes());
        }
    }

    /// Walks down from this node along the topic's literal levels in a loop, emitting what
    /// matches on the way and handing each `+` child to `branch` (which recurses or stacks
    /// it), so only `+` branches cost a call. `pos` is where the topic's next level starts
    /// (None: every level is consumed, so the topic ends at the current node).
    #[inline(always)]
    fn walk_chain<'a>(
        &'a self,
        topic: &[u8],
        mut pos: Option<usize>,
        mut dollar_root: bool,
        plain: &mut Vec<(K, SubOpts)>,
        shared: &mut Vec<SharedMatch<'a, K>>,
        mut branch: impl FnMut(
            &'a Node<K>,
            Option<usize>,
            &mut Vec<(K, SubOpts)>,
            &mut Vec<SharedMatch<'a, K>>,
        ),
    ) {
        let mut node = self;
        loop {
            // `x/#` matches every topic reaching `x`, including `x` itself; a root `#` or
            // `+` does not match `$` topics.
            if let Some(h) = &node.hash {
                if !dollar_root {
                    h.emit(plain, shared);
                }
            }
            let Some(p) = pos else {
                node.subs.emit(plain, shared);
                return;
            };
            let plus = node.plus.as_deref().filter(|_| !dollar_root);
            if node.literal.is_empty() && plus.is_none() {
                return;
            }
            let (level, next) = level_at(topic, p);
            if let Some(child) = plus {
                branch(child, next, plain, shared);
            }
            match node.literal.get(level) {
                Some(child) => node = child,
                None => return,
            }
            pos = next;
            dollar_root = false;
        }
    }

    fn walk<'a>(
        &'a self,
        topic: &[u8],
        pos: Option<usize>,
        dollar_root: bool,
        depth: usize,
        plain: &mut Vec<(K, SubOpts)>,
        shared: &mut Vec<SharedMatch<'a, K>>,
    ) {
        let branch = |child: &'a Node<K>, next, plain: &mut _, shared: &mut _| {
            if depth < RECURSION_LIMIT {
                child.walk(topic, next, false, depth + 1, plain, shared);
            } else {
                child.walk_deep(topic, next, plain, shared);
            }
        };
        self.walk_chain(topic, pos, dollar_root, plain, shared, branch);
    }

    /// The same walk with a heap stack, for what lies below `RECURSION_LIMIT` levels.
    #[cold]
    #[inline(never)]
    fn walk_deep<'a>(
        &'a self,
        topic: &[u8],
        pos: Option<usize>,
        plain: &mut Vec<(K, SubOpts)>,
        shared: &mut Vec<SharedMatch<'a, K>>,
    ) {
        let mut stack = vec![(self, pos)];
        while let Some((node, pos)) = stack.pop() {
            node.walk_chain(topic, pos, false, plain, shared, |child, next, _, _| {
                stack.push((child, next));
            });
        }
    }
}

/// The subscription index: a trie over filter levels with `+` and `#` children, holding for
/// each filter its subscribers `K` (the engine uses a small integer session id) and options,
/// and for shared filters (`$share/g/f`) the members of each group.
pub struct SubscriptionIndex<K> {
    root: Node<K>,
    len: usize,
}

/// One shared-subscription group that matched: the engine picks one member to deliver to.
pub struct SharedMatch<'a, K> {
    /// The shared subscription, `$share/{group}/{filter}`.
    pub key: &'a str,
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
        SubscriptionIndex {
            root: Node::new(),
            len: 0,
        }
    }

    /// Adds or replaces `key`'s subscription to `filter` (which may be `$share/g/f`).
    /// Returns true if it is new, false if it replaced an existing one (options updated).
    pub fn insert(&mut self, filter: &str, key: K, opts: SubOpts) -> bool {
        debug_assert!(valid_filter(filter), "invalid filter {filter:?}");
        let (group, f) = match split_shared(filter) {
            Some((g, f)) => (Some(g), f),
            None => (None, filter),
        };
        let (levels, hash_last) = filter_path(f);
        let mut node = &mut self.root;
        for level in levels {
            node = node.child_or_insert(level);
        }
        let slot = if hash_last {
            &mut **node.hash.get_or_insert_with(|| Box::new(Slot::new()))
        } else {
            &mut node.subs
        };
        let new = match group {
            None => slot.plain.upsert(key, opts),
            Some(_) => {
                let i = match slot.shared.iter().position(|s| &*s.key == filter) {
                    Some(i) => i,
                    None => {
                        slot.shared.push(SharedGroup {
                            key: filter.into(),
                            members: SubList::new(),
                            cursor: Cell::new(0),
                        });
                        slot.shared.len() - 1
                    }
                };
                slot.shared[i].members.upsert(key, opts)
            }
        };
        self.len += usize::from(new);
        new
    }

    /// Removes `key`'s subscription to `filter`; returns whether it existed. Empty trie
    /// nodes are pruned so the index does not grow with churn.
    pub fn remove(&mut self, filter: &str, key: K) -> bool {
        let (group, f) = match split_shared(filter) {
            Some((g, f)) => (Some(g), f),
            None => (None, filter),
        };
        let (levels, hash_last) = filter_path(f);
        let mut node = &mut self.root;
        for level in levels.clone() {
            match node.child_mut(level) {
                Some(child) => node = child,
                None => return false,
            }
        }
        let slot = if hash_last {
            match node.hash.as_deref_mut() {
                Some(slot) => slot,
                None => return false,
            }
        } else {
            &mut node.subs
        };
        let removed = match group {
            None => slot.plain.remove(key, false),
            Some(_) => match slot.shared.iter().position(|s| &*s.key == filter) {
                Some(i) => {
                    let removed = slot.shared[i].members.remove(key, true);
                    if slot.shared[i].members.is_empty() {
                        slot.shared.remove(i);
                    }
                    removed
                }
                None => false,
            },
        };
        if !removed {
            return false;
        }
        self.len -= 1;
        if slot.is_empty() {
            if hash_last {
                node.hash = None;
            }
            if node.is_empty() {
                self.prune(levels);
            }
        }
        true
    }

    /// Detaches the longest chain of nodes at the end of `levels` that hold nothing but the
    /// next node of the chain; the path's last node is known to be empty. Walks down again
    /// rather than recursing, so deep filters cost no stack.
    fn prune(&mut self, levels: Levels<'_>) {
        let mut cut = None;
        let mut node = &self.root;
        for (i, level) in levels.clone().enumerate() {
            node = node.child(level).expect("pruned path exists");
            let holds_only_path =
                node.subs.is_empty() && node.hash.is_none() && node.child_count() <= 1;
            if !holds_only_path {
                cut = None;
            } else if cut.is_none() {
                cut = Some(i);
            }
        }
        // The last node is empty, hence `holds_only_path`, so `cut` is set unless the path is
        // empty (the root itself is never detached).
        let Some(cut) = cut else { return };
        let mut node = &mut self.root;
        let mut levels = levels;
        for level in levels.by_ref().take(cut) {
            node = node.child_mut(level).expect("pruned path exists");
        }
        if let Some(level) = levels.next() {
            node.detach_child(level);
        }
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
        let dollar = topic.first() == Some(&b'$');
        self.root.walk(topic, Some(0), dollar, 0, plain, shared);
    }

    /// Number of (filter, key) subscriptions held, shared ones included.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Trie nodes, root included (tests check pruning with it).
    #[cfg(test)]
    fn node_count(&self) -> usize {
        let mut count = 0;
        let mut stack = vec![&self.root];
        while let Some(n) = stack.pop() {
            count += 1;
            stack.extend(n.literal.values());
            stack.extend(n.plus.as_deref());
        }
        count
    }
}

// ---------------------------------------------------------------------------------------------
// Retained tree

/// Retained topics live in an arena indexed by u32 with parent links: pruning walks up the
/// parents and `retain` scans the arena linearly, so neither recurses nor revisits the path,
/// and dropping the tree is a flat Vec drop.
struct RNode<V> {
    parent: u32,
    /// This node's level name (the key under which its parent holds it).
    level: LevelKey,
    children: FastMap<LevelKey, u32>,
    value: Option<V>,
}

const ROOT: u32 = 0;

/// Retained messages by topic, looked up by filter (for sending retained messages on
/// SUBSCRIBE): a trie over topic levels so a wildcard lookup visits only matching branches.
pub struct RetainedTree<V> {
    /// `nodes[0]` is the root (the level above the first); it never holds a value.
    nodes: Vec<RNode<V>>,
    /// Detached slots of `nodes`, reused before growing it.
    free: Vec<u32>,
    len: usize,
}

impl<V> Default for RetainedTree<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> RetainedTree<V> {
    pub fn new() -> Self {
        RetainedTree {
            nodes: vec![RNode {
                parent: ROOT,
                level: LevelKey::default(),
                children: FastMap::default(),
                value: None,
            }],
            free: Vec::new(),
            len: 0,
        }
    }

    fn node(&self, i: u32) -> &RNode<V> {
        &self.nodes[i as usize]
    }

    fn node_mut(&mut self, i: u32) -> &mut RNode<V> {
        &mut self.nodes[i as usize]
    }

    fn find(&self, topic: &[u8]) -> Option<u32> {
        let mut i = ROOT;
        for level in topic.split(|&b| b == b'/') {
            i = *self.node(i).children.get(level)?;
        }
        Some(i)
    }

    fn alloc(&mut self, parent: u32, level: &[u8]) -> u32 {
        match self.free.pop() {
            Some(i) => {
                let n = self.node_mut(i);
                n.parent = parent;
                n.level = LevelKey::new(level);
                i
            }
            None => {
                let i = u32::try_from(self.nodes.len()).expect("retained tree exceeds 2^32 nodes");
                self.nodes.push(RNode {
                    parent,
                    level: LevelKey::new(level),
                    children: FastMap::default(),
                    value: None,
                });
                i
            }
        }
    }

    /// Frees `i` and its ancestors while they hold neither a value nor children.
    fn prune_up(&mut self, mut i: u32) {
        while i != ROOT {
            let n = self.node_mut(i);
            if n.value.is_some() || !n.children.is_empty() {
                return;
            }
            let parent = n.parent;
            let level = std::mem::take(&mut n.level);
            // Release the (empty) map's table too: freed slots should cost no memory.
            n.children = FastMap::default();
            self.node_mut(parent).children.remove(level.as_bytes());
            self.free.push(i);
            i = parent;
        }
    }

    /// Sets the value for `topic`, returning the old one.
    pub fn insert(&mut self, topic: &[u8], value: V) -> Option<V> {
        debug_assert!(valid_topic_name(topic), "invalid topic {topic:?}");
        let mut i = ROOT;
        for level in topic.split(|&b| b == b'/') {
            i = match self.node(i).children.get(level) {
                Some(&c) => c,
                None => {
                    let c = self.alloc(i, level);
                    self.node_mut(i).children.insert(LevelKey::new(level), c);
                    c
                }
            };
        }
        let old = self.node_mut(i).value.replace(value);
        self.len += usize::from(old.is_none());
        old
    }

    /// Removes `topic`'s value (pruning empty nodes).
    pub fn remove(&mut self, topic: &[u8]) -> Option<V> {
        let i = self.find(topic)?;
        let old = self.node_mut(i).value.take()?;
        self.len -= 1;
        self.prune_up(i);
        Some(old)
    }

    pub fn get(&self, topic: &[u8]) -> Option<&V> {
        self.node(self.find(topic)?).value.as_ref()
    }

    /// Calls `f` for every value whose topic matches `filter` (valid, not shared), honouring
    /// the `$` rule.
    pub fn for_each_match(&self, filter: &str, mut f: impl FnMut(&V)) {
        debug_assert!(
            valid_filter(filter) && split_shared(filter).is_none(),
            "invalid filter {filter:?}"
        );
        let fb = filter.as_bytes();
        if !fb.iter().any(|&b| b == b'+' || b == b'#') {
            // No wildcard: a plain get, without allocating the walk stack.
            if let Some(v) = self.get(fb) {
                f(v);
            }
            return;
        }
        // A wildcard first level must skip `$` topics, i.e. root children named `$...`.
        let skip = |parent: u32, name: &[u8]| parent == ROOT && name.first() == Some(&b'$');
        let mut stack = vec![Walk::Match(ROOT, Some(0))];
        while let Some(w) = stack.pop() {
            match w {
                Walk::All(i) => {
                    let n = self.node(i);
                    if let Some(v) = &n.value {
                        f(v);
                    }
                    stack.extend(n.children.values().map(|&c| Walk::All(c)));
                }
                Walk::Match(i, None) => {
                    if let Some(v) = &self.node(i).value {
                        f(v);
                    }
                }
                Walk::Match(i, Some(pos)) => {
                    let n = self.node(i);
                    let (level, next) = level_at(fb, pos);
                    match level {
                        b"#" => {
                            // The parent level too ("a/#" matches "a"); the root holds none.
                            if let Some(v) = &n.value {
                                f(v);
                            }
                            let kids = n.children.iter().filter(|(k, _)| !skip(i, k.as_bytes()));
                            stack.extend(kids.map(|(_, &c)| Walk::All(c)));
                        }
                        b"+" => {
                            let kids = n.children.iter().filter(|(k, _)| !skip(i, k.as_bytes()));
                            stack.extend(kids.map(|(_, &c)| Walk::Match(c, next)));
                        }
                        _ => {
                            if let Some(&c) = n.children.get(level) {
                                stack.push(Walk::Match(c, next));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.nodes.iter().filter_map(|n| n.value.as_ref())
    }

    /// Removes every value for which `keep` returns false (used to drop expired messages).
    pub fn retain(&mut self, mut keep: impl FnMut(&V) -> bool) {
        // Pruning frees only nodes without a value, so the rest of the scan is unaffected.
        for i in 0..self.nodes.len() {
            let drop = matches!(&self.nodes[i].value, Some(v) if !keep(v));
            if drop {
                self.nodes[i].value = None;
                self.len -= 1;
                self.prune_up(i as u32);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Live trie nodes, root included (tests check pruning with it).
    #[cfg(test)]
    fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

/// A pending step of `RetainedTree::for_each_match`.
enum Walk {
    /// Match the filter from byte `pos` (None: filter consumed) against node's children.
    Match(u32, Option<usize>),
    /// Everything at and below the node (after a `#`).
    All(u32),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn opts(identifier: u32) -> SubOpts {
        SubOpts {
            qos: QoS::AtLeastOnce,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
            identifier,
        }
    }

    /// Plain keys and shared member lists that `idx` returns for `topic`, sorted.
    fn lookup_keys(idx: &SubscriptionIndex<u32>, topic: &str) -> (Vec<u32>, Vec<Vec<u32>>) {
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(topic.as_bytes(), &mut plain, &mut shared);
        let mut keys: Vec<u32> = plain.iter().map(|e| e.0).collect();
        keys.sort_unstable();
        let mut groups: Vec<Vec<u32>> = shared
            .iter()
            .map(|m| m.members.iter().map(|e| e.0).collect())
            .collect();
        groups.sort();
        (keys, groups)
    }

    fn retained_values(tree: &RetainedTree<u32>, filter: &str) -> Vec<u32> {
        let mut out = Vec::new();
        tree.for_each_match(filter, |v| out.push(*v));
        out.sort_unstable();
        out
    }

    /// Level names differing only in their last bytes must spread over both the bucket bits
    /// (low) and the tag bits (top 7) that hashbrown uses; a plain Fx multiply fails this.
    #[test]
    fn hasher_spreads_similar_keys() {
        use std::collections::HashSet;
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<FoldHasher>::default();
        let key_sets: [Vec<String>; 3] = [
            (0..1000).map(|i| format!("room{i}")).collect(),
            (0..1000).map(|i| (i * 100).to_string()).collect(),
            (0..1000)
                .map(|i| format!("sensor-{i:04}-temperature"))
                .collect(),
        ];
        for keys in &key_sets {
            let hashes: Vec<u64> = keys.iter().map(|k| build.hash_one(k.as_bytes())).collect();
            let buckets: HashSet<u64> = hashes.iter().map(|h| h & 1023).collect();
            let tags: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
            // Random hashes give ~630 distinct buckets of 1024 and all 128 tags.
            assert!(
                buckets.len() > 560,
                "{} buckets for {:?}..",
                buckets.len(),
                keys[1]
            );
            assert!(tags.len() > 120, "{} tags for {:?}..", tags.len(), keys[1]);
        }
        // Integer keys (session ids) too.
        let ids: HashSet<u64> = (0..1000u32).map(|i| build.hash_one(i) & 1023).collect();
        assert!(ids.len() > 560);
    }

    /// The engine keeps both trees in a struct that must move between threads.
    #[test]
    fn trees_are_send() {
        fn send<T: Send>() {}
        send::<SubscriptionIndex<u32>>();
        send::<RetainedTree<std::sync::Arc<Vec<u8>>>>();
    }

    #[test]
    fn topic_name_validation() {
        let long = "a".repeat(MAX_LEN);
        let too_long = "a".repeat(MAX_LEN + 1);
        let table: &[(&str, bool)] = &[
            ("a", true),
            ("/", true),
            ("a/b/c", true),
            ("/finance", true),
            ("$SYS/broker", true),
            (" ", true),
            ("sport/tennis/player1", true),
            ("", false),
            ("a/+", false),
            ("a/#", false),
            ("+", false),
            ("sport+", false),
            ("a\0b", false),
            (&long, true),
            (&too_long, false),
        ];
        for &(t, ok) in table {
            assert_eq!(valid_topic_name(t.as_bytes()), ok, "{t:?}");
        }
    }

    #[test]
    fn filter_validation() {
        let long = "a".repeat(MAX_LEN);
        let too_long = "a".repeat(MAX_LEN + 1);
        let table: &[(&str, bool)] = &[
            // §4.7.1.2
            ("sport/tennis/player1/#", true),
            ("#", true),
            ("sport/tennis/#", true),
            ("sport/tennis#", false),
            ("sport/tennis/#/ranking", false),
            ("#/a", false),
            ("a/##", false),
            // §4.7.1.3
            ("+", true),
            ("+/tennis/#", true),
            ("sport+", false),
            ("sport/+/player1", true),
            ("+/+", true),
            ("/+", true),
            ("+/", true),
            ("a/++/b", false),
            ("a/+b", false),
            ("+#", false),
            ("/", true),
            ("//", true),
            ("", false),
            ("a\0", false),
            ("$SYS/#", true),
            // shared subscriptions (§4.8.2)
            ("$share/g/a/b", true),
            ("$share/g/#", true),
            ("$share/g/+/x", true),
            ("$share/g//", true),
            ("$share/g/", false),
            ("$share/g", false),
            ("$share/", false),
            ("$share//a", false),
            ("$share/g+/a", false),
            ("$share/g#/a", false),
            ("$share/+/a", false),
            ("$share/g/a#", false),
            ("$share/g/a/#/b", false),
            ("$share/g\0/a", false),
            ("$share", true),
            ("$sharex/a", true),
            (&long, true),
            (&too_long, false),
        ];
        for &(f, ok) in table {
            assert_eq!(valid_filter(f), ok, "{f:?}");
        }
    }

    #[test]
    fn shared_split() {
        assert_eq!(split_shared("$share/g/a/b"), Some(("g", "a/b")));
        assert_eq!(split_shared("$share/grp/#"), Some(("grp", "#")));
        assert_eq!(split_shared("$share/g/"), Some(("g", "")));
        assert_eq!(split_shared("$share/g"), None);
        assert_eq!(split_shared("$share"), None);
        assert_eq!(split_shared("a/$share/g/b"), None);
        assert_eq!(split_shared("$SHARE/g/b"), None);
        assert_eq!(split_shared("#"), None);
    }

    /// (filter, topic, matches): the examples of MQTT 5 §4.7 and a few edges.
    const MATCH_TABLE: &[(&str, &str, bool)] = &[
        ("sport/tennis/player1/#", "sport/tennis/player1", true),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/ranking",
            true,
        ),
        (
            "sport/tennis/player1/#",
            "sport/tennis/player1/score/wimbledon",
            true,
        ),
        ("sport/tennis/player1/#", "sport/tennis/player2", false),
        ("sport/tennis/player1/#", "sport/tennis", false),
        ("sport/#", "sport", true),
        ("sport/#", "sport/", true),
        ("sport/#", "sports", false),
        ("#", "sport/tennis", true),
        ("#", "/", true),
        ("sport/tennis/+", "sport/tennis/player1", true),
        ("sport/tennis/+", "sport/tennis/player2", true),
        ("sport/tennis/+", "sport/tennis/player1/ranking", false),
        ("sport/+", "sport", false),
        ("sport/+", "sport/", true),
        ("+/+", "/finance", true),
        ("/+", "/finance", true),
        ("+", "/finance", false),
        ("#", "/finance", true),
        ("+/#", "/finance", true),
        ("+/tennis/#", "sport/tennis", true),
        ("sport/+/player1", "sport/tennis/player1", true),
        ("sport/+/player1", "sport//player1", true),
        ("+", "a", true),
        ("/", "/", true),
        ("+/+", "/", true),
        ("+", "/", false),
        ("ACCOUNTS", "Accounts", false),
        ("finance", "/finance", false),
        // §4.7.2: topics starting with `$`
        ("#", "$SYS/monitor/Clients", false),
        ("+/monitor/Clients", "$SYS/monitor/Clients", false),
        ("$SYS/#", "$SYS/monitor/Clients", true),
        ("$SYS/monitor/+", "$SYS/monitor/Clients", true),
        ("$SYS/#", "$SYS", true),
        ("+", "$SYS", false),
        ("#", "$", false),
        ("a/#", "a/$x", true),
        ("a/+", "a/$x", true),
        ("$SYS", "$SYS", true),
    ];

    #[test]
    fn matches_spec_examples() {
        for &(f, t, want) in MATCH_TABLE {
            assert_eq!(matches(f, t.as_bytes()), want, "{f:?} vs {t:?}");
        }
    }

    #[test]
    fn index_and_retained_agree_with_spec_examples() {
        for (i, &(f, t, want)) in MATCH_TABLE.iter().enumerate() {
            let mut idx = SubscriptionIndex::new();
            idx.insert(f, 7u32, opts(0));
            idx.insert(&format!("$share/g/{f}"), 8u32, opts(0));
            let (plain, groups) = lookup_keys(&idx, t);
            let (want_plain, want_groups) = if want {
                (vec![7], vec![vec![8]])
            } else {
                (vec![], vec![])
            };
            assert_eq!(
                (plain, groups),
                (want_plain, want_groups),
                "#{i} {f:?} vs {t:?}"
            );

            let mut tree = RetainedTree::new();
            tree.insert(t.as_bytes(), 1u32);
            let got = retained_values(&tree, f);
            assert_eq!(got == [1], want, "retained #{i} {f:?} vs {t:?}");
        }
    }

    #[test]
    fn overlapping_filters_yield_key_once_per_filter() {
        let mut idx = SubscriptionIndex::new();
        for (n, f) in ["a/b", "a/+", "+/b", "#", "a/#", "+/+", "a/b/#", "a/c"]
            .iter()
            .enumerate()
        {
            assert!(idx.insert(f, 1u32, opts(n as u32)));
        }
        idx.insert("a/b", 2, opts(100));
        assert_eq!(idx.len(), 9);
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(b"a/b", &mut plain, &mut shared);
        // Seven of key 1's filters match (not "a/c"), each with its own options.
        let mut ids: Vec<(u32, u32)> = plain.iter().map(|e| (e.0, e.1.identifier)).collect();
        ids.sort_unstable();
        assert_eq!(
            ids,
            [
                (1, 0),
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 4),
                (1, 5),
                (1, 6),
                (2, 100)
            ]
        );
        assert!(shared.is_empty());
    }

    #[test]
    fn insert_replaces_options() {
        let mut idx = SubscriptionIndex::new();
        assert!(idx.insert("a/+", 1u32, opts(1)));
        assert!(!idx.insert("a/+", 1, opts(2)));
        assert!(idx.insert("$share/g/a/+", 1, opts(3)));
        assert!(!idx.insert("$share/g/a/+", 1, opts(4)));
        assert_eq!(idx.len(), 2);
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(b"a/x", &mut plain, &mut shared);
        assert_eq!(plain, [(1, opts(2))]);
        assert_eq!(shared.len(), 1);
        assert_eq!(shared[0].members, [(1, opts(4))]);
    }

    #[test]
    fn shared_groups() {
        let mut idx = SubscriptionIndex::new();
        idx.insert("$share/g1/a/+", 3u32, opts(0));
        idx.insert("$share/g1/a/+", 1, opts(0));
        idx.insert("$share/g1/a/+", 2, opts(0));
        idx.insert("$share/g1/a/+", 1, opts(9)); // replace keeps the position
        idx.insert("$share/g2/a/+", 1, opts(0));
        idx.insert("$share/g1/a/b", 4, opts(0));
        idx.insert("$share/g1/#", 5, opts(0));
        idx.insert("a/+", 1, opts(0));
        assert_eq!(idx.len(), 7);

        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(b"a/b", &mut plain, &mut shared);
        assert_eq!(plain, [(1, opts(0))]);
        let mut groups: Vec<Vec<(u32, u32)>> = shared
            .iter()
            .map(|m| m.members.iter().map(|e| (e.0, e.1.identifier)).collect())
            .collect();
        groups.sort();
        // Same group name on different filters are distinct groups; members in insertion order.
        assert_eq!(
            groups,
            [
                vec![(1, 0)],
                vec![(3, 0), (1, 9), (2, 0)],
                vec![(4, 0)],
                vec![(5, 0)],
            ]
        );

        // The cursor belongs to the group and survives between lookups.
        let g1 = shared.iter().find(|m| m.members.len() == 3).unwrap();
        g1.cursor.set(g1.cursor.get() + 1);
        let (mut plain2, mut shared2) = (Vec::new(), Vec::new());
        idx.lookup(b"a/z", &mut plain2, &mut shared2);
        let g1 = shared2.iter().find(|m| m.members.len() == 3).unwrap();
        assert_eq!(g1.cursor.get(), 1);

        // Removing a member keeps the others in order; the last member removes the group.
        assert!(idx.remove("$share/g1/a/+", 3));
        assert!(!idx.remove("$share/g1/a/+", 3));
        assert!(!idx.remove("$share/nope/a/+", 1));
        let (_, groups) = lookup_keys(&idx, "a/z");
        assert_eq!(groups, [vec![1], vec![1, 2], vec![5]]);
        assert!(idx.remove("$share/g2/a/+", 1));
        let (_, groups) = lookup_keys(&idx, "a/z");
        assert_eq!(groups, [vec![1, 2], vec![5]]);
        // `$` topics are not matched by a shared `#` either.
        assert_eq!(lookup_keys(&idx, "$x/a"), (vec![], vec![]));
    }

    #[test]
    fn removal_prunes_to_empty() {
        let filters = [
            "a/b/c",
            "a/b",
            "a/#",
            "a/+/c",
            "+/+/+",
            "#",
            "/",
            "//",
            "/#",
            "+",
            "$SYS/#",
            "$share/g/a/b/c/d",
            "$share/h/+/#",
        ];
        let mut idx = SubscriptionIndex::new();
        assert_eq!(idx.node_count(), 1);
        for (i, f) in filters.iter().enumerate() {
            assert!(idx.insert(f, 1u32, opts(0)));
            assert!(idx.insert(f, 2, opts(0)));
            assert_eq!(idx.len(), 2 * (i + 1));
        }
        assert!(idx.node_count() > 10);
        assert!(!idx.remove("a/b/c/d", 1));
        assert!(!idx.remove("x", 1));
        assert!(!idx.remove("a/b", 3));
        // Remove in an order that leaves interior nodes alive while leaves go first and
        // the other way round.
        for f in filters.iter().rev() {
            assert!(idx.remove(f, 1));
        }
        for f in filters.iter() {
            assert!(idx.remove(f, 2));
            assert!(!idx.remove(f, 2));
        }
        assert!(idx.is_empty());
        assert_eq!(idx.len(), 0);
        assert_eq!(idx.node_count(), 1);
        assert!(idx.root.is_empty());

        // Partial removal keeps exactly what is still needed.
        idx.insert("a/b/c/d", 1, opts(0));
        idx.insert("a/b", 1, opts(0));
        let full = idx.node_count();
        assert_eq!(full, 5);
        idx.remove("a/b/c/d", 1);
        assert_eq!(idx.node_count(), 3);
        idx.insert("a/b/c/d", 1, opts(0));
        idx.remove("a/b", 1);
        assert_eq!(idx.node_count(), full);
        assert_eq!(lookup_keys(&idx, "a/b/c/d").0, [1]);
        idx.remove("a/b/c/d", 1);
        assert_eq!(idx.node_count(), 1);
    }

    #[test]
    fn many_subscribers_of_one_filter() {
        const N: u32 = 50_000;
        let mut idx = SubscriptionIndex::new();
        for k in 0..N {
            assert!(idx.insert("hot/topic", k, opts(k)));
            assert!(idx.insert("$share/g/hot/topic", k, opts(k)));
        }
        for k in (0..N).step_by(7) {
            assert!(!idx.insert("hot/topic", k, opts(k + 1)));
        }
        assert_eq!(idx.len(), 2 * N as usize);
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(b"hot/topic", &mut plain, &mut shared);
        assert_eq!(plain.len(), N as usize);
        assert!(plain
            .iter()
            .all(|e| e.1.identifier == e.0 + u32::from(e.0 % 7 == 0)));
        assert_eq!(shared[0].members.len(), N as usize);
        drop((plain, shared));

        // Remove the plain ones in an order that exercises swap_remove's index fix-up.
        for k in (0..N)
            .filter(|k| k % 2 == 0)
            .chain((0..N).filter(|k| k % 2 == 1))
        {
            assert!(idx.remove("hot/topic", k));
        }
        assert!(!idx.remove("hot/topic", 0));
        // Shared members: remove from the back so order-preserving removal stays cheap, and
        // check order and index consistency on the way.
        for k in (100..N).rev() {
            assert!(idx.remove("$share/g/hot/topic", k));
        }
        let (_, groups) = lookup_keys(&idx, "hot/topic");
        assert_eq!(groups, [(0..100).collect::<Vec<_>>()]);
        for k in [50, 0, 99, 1] {
            assert!(idx.remove("$share/g/hot/topic", k));
            assert!(!idx.remove("$share/g/hot/topic", k));
        }
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(b"hot/topic", &mut plain, &mut shared);
        let order: Vec<u32> = shared[0].members.iter().map(|e| e.0).collect();
        let want: Vec<u32> = (2..99).filter(|&k| k != 50).collect();
        assert_eq!(order, want);
        drop((plain, shared));
        for k in want {
            assert!(idx.remove("$share/g/hot/topic", k));
        }
        assert!(idx.is_empty());
        assert_eq!(idx.node_count(), 1);
    }

    /// A 30k-level filter and topic (the most a 65535-byte string allows is 32768): lookup,
    /// pruning and drop must not recurse per level.
    #[test]
    fn very_deep_filters_do_not_overflow_the_stack() {
        let run = || {
            let levels = 30_000;
            let topic = vec!["x"; levels].join("/");
            let plus = vec!["+"; levels].join("/");
            let hash = format!("{}/#", vec!["x"; levels - 1].join("/"));
            let mut idx = SubscriptionIndex::new();
            idx.insert(&topic, 1u32, opts(0));
            idx.insert(&plus, 2, opts(0));
            idx.insert(&hash, 3, opts(0));
            idx.insert("x/+/x/#", 4, opts(0));
            assert_eq!(lookup_keys(&idx, &topic).0, [1, 2, 3, 4]);
            assert!(idx.remove(&topic, 1));
            assert!(idx.remove(&hash, 3));
            assert_eq!(lookup_keys(&idx, &topic).0, [2, 4]);
            assert!(idx.remove(&plus, 2));
            assert!(idx.remove("x/+/x/#", 4));
            assert_eq!(idx.node_count(), 1);
            // Dropping a deep index in one piece.
            idx.insert(&topic, 1u32, opts(0));
            drop(idx);

            let mut tree = RetainedTree::new();
            tree.insert(topic.as_bytes(), 1u32);
            assert_eq!(retained_values(&tree, "#"), [1]);
            assert_eq!(retained_values(&tree, &plus), [1]);
            tree.retain(|_| false);
            assert_eq!(tree.node_count(), 1);
        };
        // A small stack, like a worker thread's, makes any per-level recursion fail loudly.
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(run)
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn retained_basics() {
        let mut tree = RetainedTree::new();
        assert!(tree.is_empty());
        assert_eq!(tree.insert(b"a/b", 1u32), None);
        assert_eq!(tree.insert(b"a/b", 2), Some(1));
        assert_eq!(tree.insert(b"a", 3), None);
        assert_eq!(tree.insert(b"a/b/c", 4), None);
        assert_eq!(tree.insert(b"$SYS/x", 5), None);
        assert_eq!(tree.insert(b"/", 6), None);
        assert_eq!(tree.len(), 5);
        assert_eq!(tree.get(b"a/b"), Some(&2));
        assert_eq!(tree.get(b"a/b/c/d"), None);
        assert_eq!(tree.get(b"a/"), None);

        assert_eq!(retained_values(&tree, "#"), [2, 3, 4, 6]);
        assert_eq!(retained_values(&tree, "a/#"), [2, 3, 4]);
        assert_eq!(retained_values(&tree, "a/+"), [2]);
        assert_eq!(retained_values(&tree, "+"), [3]);
        assert_eq!(retained_values(&tree, "+/+"), [2, 6]);
        assert_eq!(retained_values(&tree, "$SYS/#"), [5]);
        assert_eq!(retained_values(&tree, "$SYS/+"), [5]);
        assert_eq!(retained_values(&tree, "+/x"), Vec::<u32>::new());
        assert_eq!(retained_values(&tree, "a/b"), [2]);
        assert_eq!(retained_values(&tree, "a/x"), Vec::<u32>::new());

        assert_eq!(tree.remove(b"a/b"), Some(2));
        assert_eq!(tree.remove(b"a/b"), None);
        assert_eq!(tree.remove(b"zz"), None);
        assert_eq!(tree.get(b"a/b/c"), Some(&4));
        tree.retain(|v| *v != 4);
        assert_eq!(tree.len(), 3);
        // a, $SYS, $SYS/x, "", "" under it, plus root.
        assert_eq!(tree.node_count(), 6);
        tree.retain(|_| false);
        assert!(tree.is_empty());
        assert_eq!(tree.node_count(), 1);
        // Freed slots are reused.
        let slots = tree.nodes.len();
        tree.insert(b"p/q", 1);
        assert_eq!(tree.nodes.len(), slots);
        assert_eq!(retained_values(&tree, "p/q"), [1]);
    }

    // -----------------------------------------------------------------------------------------
    // Property tests against brute force over `matches`.

    /// Topic levels from a tiny alphabet so random filters and topics collide often.
    fn topic_level() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["a", "b", "", "$s"])
    }

    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(topic_level(), 1..5)
            .prop_map(|l| l.join("/"))
            .prop_filter("valid", |t| valid_topic_name(t.as_bytes()))
    }

    fn filter() -> impl Strategy<Value = String> {
        let level = prop::sample::select(vec!["a", "b", "", "$s", "+", "+"]);
        (prop::collection::vec(level, 0..4), any::<bool>())
            .prop_map(|(mut levels, hash)| {
                if hash || levels.is_empty() {
                    levels.push("#");
                }
                levels.join("/")
            })
            .prop_filter("valid", |f| valid_filter(f))
    }

    /// A subscription: filter, key, and an optional shared group.
    fn subscription() -> impl Strategy<Value = (String, u32, Option<&'static str>)> {
        let group = prop::option::weighted(0.3, prop::sample::select(vec!["g", "h"]));
        (filter(), 0..4u32, group)
    }

    /// The index's model: (group, inner filter) -> members in order; group None = plain.
    type Model = BTreeMap<(Option<&'static str>, String), Vec<(u32, SubOpts)>>;

    fn full_filter(group: Option<&str>, f: &str) -> String {
        match group {
            Some(g) => format!("$share/{g}/{f}"),
            None => f.to_string(),
        }
    }

    fn check_lookup(idx: &SubscriptionIndex<u32>, model: &Model, topic: &str) {
        let (mut plain, mut shared) = (Vec::new(), Vec::new());
        idx.lookup(topic.as_bytes(), &mut plain, &mut shared);
        let mut got_plain: Vec<(u32, u32)> = plain.iter().map(|e| (e.0, e.1.identifier)).collect();
        got_plain.sort_unstable();
        let mut got_shared: Vec<Vec<(u32, u32)>> = shared
            .iter()
            .map(|m| m.members.iter().map(|e| (e.0, e.1.identifier)).collect())
            .collect();
        got_shared.sort();

        let (mut want_plain, mut want_shared) = (Vec::new(), Vec::new());
        for ((group, f), members) in model {
            if members.is_empty() || !matches(f, topic.as_bytes()) {
                continue;
            }
            let m = members.iter().map(|e| (e.0, e.1.identifier));
            match group {
                None => want_plain.extend(m),
                Some(_) => want_shared.push(m.collect::<Vec<_>>()),
            }
        }
        want_plain.sort_unstable();
        want_shared.sort();
        assert_eq!(got_plain, want_plain, "plain for {topic:?}");
        // Unsorted inside each group: members keep insertion order.
        assert_eq!(got_shared, want_shared, "shared for {topic:?}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn index_lookup_matches_brute_force(
            subs in prop::collection::vec(subscription(), 0..24),
            removals in prop::collection::vec((any::<prop::sample::Index>(), any::<bool>()), 0..24),
            topics in prop::collection::vec(topic(), 1..8),
        ) {
            let mut idx = SubscriptionIndex::new();
            let mut model = Model::new();
            for (n, (f, key, group)) in subs.iter().enumerate() {
                let o = opts(n as u32);
                let members = model.entry((*group, f.clone())).or_default();
                let want_new = match members.iter_mut().find(|e| e.0 == *key) {
                    Some(e) => { e.1 = o; false }
                    None => { members.push((*key, o)); true }
                };
                prop_assert_eq!(idx.insert(&full_filter(*group, f), *key, o), want_new);
            }
            let count = |m: &Model| m.values().map(Vec::len).sum::<usize>();
            prop_assert_eq!(idx.len(), count(&model));
            for t in &topics {
                check_lookup(&idx, &model, t);
            }

            // Remove some (and some twice, or with another key), then check again.
            if !subs.is_empty() {
                for (i, other_key) in &removals {
                    let (f, key, group) = &subs[i.index(subs.len())];
                    let key = if *other_key { key + 1 } else { *key };
                    let members = model.get_mut(&(*group, f.clone())).unwrap();
                    let pos = members.iter().position(|e| e.0 == key);
                    if let Some(p) = pos {
                        members.remove(p);
                    }
                    prop_assert_eq!(idx.remove(&full_filter(*group, f), key), pos.is_some());
                }
            }
            prop_assert_eq!(idx.len(), count(&model));
            for t in &topics {
                check_lookup(&idx, &model, t);
            }

            for ((group, f), members) in &model {
                for (key, _) in members {
                    prop_assert!(idx.remove(&full_filter(*group, f), *key));
                }
            }
            prop_assert!(idx.is_empty());
            prop_assert_eq!(idx.node_count(), 1);
        }

        #[test]
        fn retained_matches_brute_force(
            entries in prop::collection::vec(topic(), 0..24),
            removals in prop::collection::vec(topic(), 0..8),
            filters in prop::collection::vec(filter(), 1..8),
            keep_mod in 1..4u32,
        ) {
            let mut tree = RetainedTree::new();
            let mut model: BTreeMap<String, u32> = BTreeMap::new();
            for (v, t) in entries.iter().enumerate() {
                let v = v as u32;
                prop_assert_eq!(tree.insert(t.as_bytes(), v), model.insert(t.clone(), v));
            }
            for t in &removals {
                prop_assert_eq!(tree.remove(t.as_bytes()), model.remove(t));
            }
            let check = |tree: &RetainedTree<u32>, model: &BTreeMap<String, u32>| {
                assert_eq!(tree.len(), model.len());
                for f in &filters {
                    let mut want: Vec<u32> = model
                        .iter()
                        .filter(|(t, _)| matches(f, t.as_bytes()))
                        .map(|(_, &v)| v)
                        .collect();
                    want.sort_unstable();
                    assert_eq!(retained_values(tree, f), want, "filter {f:?}");
                }
                for (t, v) in model {
                    assert_eq!(tree.get(t.as_bytes()), Some(v));
                }
            };
            check(&tree, &model);
            tree.retain(|v| v % keep_mod == 0);
            model.retain(|_, v| *v % keep_mod == 0);
            check(&tree, &model);
            for t in model.keys() {
                prop_assert!(tree.remove(t.as_bytes()).is_some());
            }
            prop_assert!(tree.is_empty());
            prop_assert_eq!(tree.node_count(), 1);
        }
    }
}
