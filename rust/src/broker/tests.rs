// engine tests come here
