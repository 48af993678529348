//! `Slots<T>`: a table of values by small integer id (connections, sessions, sockets), kept
//! in fixed pages rather than one growing vector.
//!
//! Why pages: a vector of 100,000 connections doubles by copying into a new block, and the
//! allocator keeps the old block's pages resident for later use, so a table that grew costs
//! about twice its size in RSS (measured: 50 bytes per idle connection of the engine's two
//! tables). Pages never move: growing adds one, and memory is what the entries use.

/// Entries per page: 256 sessions of about 200 bytes are a 50 KB block.
const PAGE: usize = 256;

pub struct Slots<T> {
    pages: Vec<Box<[Option<T>]>>,
    /// One past the highest id ever set (ids below it may be empty).
    len: usize,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            pages: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slots<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// One past the highest id set so far: every id in use is below it.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, id: usize) -> Option<&T> {
        self.pages.get(id / PAGE)?[id % PAGE].as_ref()
    }

    pub fn get_mut(&mut self, id: usize) -> Option<&mut T> {
        self.pages.get_mut(id / PAGE)?[id % PAGE].as_mut()
    }

    /// Puts `value` at `id` (growing as needed), returning what was there.
    pub fn set(&mut self, id: usize, value: T) -> Option<T> {
        while self.pages.len() <= id / PAGE {
            self.pages.push((0..PAGE).map(|_| None).collect());
        }
        self.len = self.len.max(id + 1);
        self.pages[id / PAGE][id % PAGE].replace(value)
    }

    /// Puts `value` at the next id never used, and returns that id.
    pub fn push(&mut self, value: T) -> usize {
        let id = self.len;
        self.set(id, value);
        id
    }

    pub fn take(&mut self, id: usize) -> Option<T> {
        self.pages.get_mut(id / PAGE)?[id % PAGE].take()
    }

    /// The values present, with their ids, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.pages
            .iter()
            .flat_map(|page| page.iter())
            .enumerate()
            .filter_map(|(id, slot)| slot.as_ref().map(|v| (id, v)))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        self.pages
            .iter_mut()
            .flat_map(|page| page.iter_mut())
            .enumerate()
            .filter_map(|(id, slot)| slot.as_mut().map(|v| (id, v)))
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.iter().map(|(_, v)| v)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.iter_mut().map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_across_pages() {
        let mut s: Slots<String> = Slots::new();
        assert!(s.is_empty() && s.get(0).is_none() && s.take(5).is_none());
        for i in 0..(PAGE * 2 + 3) {
            assert_eq!(s.push(i.to_string()), i);
        }
        assert_eq!(s.len(), PAGE * 2 + 3);
        assert_eq!(s.get(PAGE).map(String::as_str), Some("256"));
        assert_eq!(s.take(PAGE), Some("256".to_string()));
        assert!(s.get(PAGE).is_none());
        assert_eq!(s.set(PAGE, "x".into()), None);
        assert_eq!(s.set(PAGE, "y".into()), Some("x".into()));
        *s.get_mut(1).unwrap() = "one".into();
        assert_eq!(s.iter().nth(1), Some((1, &"one".to_string())));
        // Setting far past the end grows; the ids between stay empty.
        s.set(PAGE * 5, "far".into());
        assert_eq!(s.len(), PAGE * 5 + 1);
        assert!(s.get(PAGE * 4).is_none());
        assert_eq!(s.values().count(), PAGE * 2 + 4);
        for (id, v) in s.iter_mut() {
            if id == PAGE * 5 {
                v.push('!');
            }
        }
        assert_eq!(s.get(PAGE * 5).map(String::as_str), Some("far!"));
        assert_eq!(s.push("next".into()), PAGE * 5 + 1);
    }
}
